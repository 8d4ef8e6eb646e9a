"""One optimizer step's forward and backward in world-size-invariant training.

Each micro-batch runs with the global streams seeded for its global slot and each block's layer
(``streams.py``); its gradients are summed in slot order (``reduction.py``: autograd's accumulation on one
process, :class:`~.reduction.SlotOrderExchange` on several) and divided by the number of micro-batches; the
losses are gathered and summed in slot order. The
same operations at every process count: every rank ends with the same gradient bits (its shard of them when
sharded) and the same loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager, Sequence

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_rng.config import JobConfig
from torchtitan_rng.parallel.invariant.reduction import SlotOrderExchange
from torchtitan_rng.parallel.invariant.streams import MicroBatchStreams
from torchtitan_rng.train_spec import Batch


@dataclass(frozen=True)
class Layout:
    """``micro_batches`` per step over all ranks; this rank runs slots ``rank, rank + world, ...``: round ``i``
    of a step runs slots ``i * world .. i * world + world - 1``, one per rank."""

    micro_batches: int
    rank: int
    world: int

    @property
    def per_rank(self) -> int:
        return self.micro_batches // self.world

    @property
    def first_slot(self) -> int:
        return self.rank

    def slot(self, round_: int) -> int:
        return round_ * self.world + self.rank


def mean_loss_in_slot_order(losses: torch.Tensor, layout: Layout,
                            group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The mean of all ranks' micro-batch losses (``losses``: this rank's, by round), summed in slot order;
    ``group``: the ranks of the layout (default: all)."""
    if layout.world > 1:
        gathered = torch.empty(layout.world * losses.numel(), dtype=losses.dtype, device=losses.device)
        dist.all_gather_into_tensor(gathered, losses, group=group)
        losses = gathered.view(layout.world, layout.per_rank).t().reshape(-1)  # [rank, round] -> slot order
    return losses.sum() / layout.micro_batches


def divide_grads(params: list[nn.Parameter], layout: Layout) -> None:
    """The step's gradient sum, divided into the mean over all micro-batches."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.div_(layout.micro_batches)


def forward_backward(model: nn.Module, params: list[nn.Parameter], next_batch: Callable[[], Batch],
                     loss_fn: Callable[[nn.Module, Batch, JobConfig], torch.Tensor], config: JobConfig,
                     layout: Layout, step: int, compute_context: Callable[[], ContextManager],
                     exchanges: Sequence[SlotOrderExchange], streams: MicroBatchStreams) -> torch.Tensor:
    """Run this rank's micro-batches of ``step``, leave the mean gradient over all ``layout.micro_batches`` in
    ``p.grad`` (this rank's shard when sharded) and return the mean loss (identical on every rank).
    ``compute_context``: entered around each micro-batch's forward and loss (autocast, or a null context);
    ``exchanges``: the sharded modules' reductions (none on one process); ``streams``: the micro-batches'
    random streams."""
    for exchange in exchanges:
        exchange.begin_step()
    losses = []
    for round_ in range(layout.per_rank):
        batch = next_batch()
        streams.enter(step, layout.slot(round_))
        with compute_context():
            loss = loss_fn(model, batch, config)
        loss.backward()
        losses.append(loss.detach().float())
        if exchanges and round_ < layout.per_rank - 1:
            for p in params:  # the gradients are views of the exchanges' shards: FSDP2 must assign, not add
                p.grad = None
    divide_grads(params, layout)
    return mean_loss_in_slot_order(torch.stack(losses), layout)
