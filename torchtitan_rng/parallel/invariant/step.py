"""Where a world-size-invariant step's micro-batches run, and how its gradients and losses end.

Each micro-batch runs with the global streams seeded for its global slot and each block's layer
(``streams.py``); its gradients are summed in slot order (``reduction.py``: autograd's accumulation on one
process, :class:`~.reduction.SlotOrderExchange` on several) and divided by the number of micro-batches; the
losses are gathered and summed in slot order. The same operations at every process count: every rank ends with
the same gradient bits (its shard of them when sharded) and the same loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Slots:
    """``micro_batches`` per step over all data shards; shard ``rank`` of ``world`` runs slots ``rank, rank + world,
    ...``: round ``i`` of a step runs slots ``i * world .. i * world + world - 1``, one per shard."""

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

def mean_loss_in_slot_order(losses: torch.Tensor, slots: Slots,
                            group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The mean of all ranks' micro-batch losses (``losses``: this rank's, by round), summed in slot order;
    ``group``: the ranks of the slots (default: all)."""
    if slots.world > 1:
        gathered = torch.empty(slots.world * losses.numel(), dtype=losses.dtype, device=losses.device)
        dist.all_gather_into_tensor(gathered, losses, group=group)
        losses = gathered.view(slots.world, slots.per_rank).t().reshape(-1)  # [rank, round] -> slot order
    return losses.sum() / slots.micro_batches

def divide_grads(params: list[nn.Parameter], slots: Slots) -> None:
    """The step's gradient sum, divided into the mean over all micro-batches."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.div_(slots.micro_batches)
