"""One optimizer step's forward and backward in world-size-invariant training.

Each micro-batch runs with the global streams seeded for its global slot, its gradients (and its loss, as
one more element) flattened into one buffer; the buffers are summed in the canonical tree
(``reduction.py``) and divided by the number of micro-batches, the same operations at every process count.
Every rank ends with identical full gradients and the same loss, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch import nn

from torchtitan_rng.config import JobConfig
from torchtitan_rng.parallel.invariant.reduction import butterfly_sum, tree_sum
from torchtitan_rng.rng import seed_micro_batch_streams
from torchtitan_rng.train_spec import Batch


@dataclass(frozen=True)
class Layout:
    """``micro_batches`` per step over all ranks; this rank runs the contiguous block starting at ``first_slot``."""

    micro_batches: int
    rank: int
    world: int

    @property
    def per_rank(self) -> int:
        return self.micro_batches // self.world

    @property
    def first_slot(self) -> int:
        return self.rank * self.per_rank


def _flatten(params: list[nn.Parameter], loss: torch.Tensor) -> torch.Tensor:
    """This micro-batch's gradients and loss in one float32 buffer (a parameter without gradient: zeros)."""
    parts = [p.grad.reshape(-1).float() if p.grad is not None else p.new_zeros(p.numel(), dtype=torch.float32)
             for p in params]
    return torch.cat([*parts, loss.detach().float().reshape(1)])


def _unflatten_into_grads(params: list[nn.Parameter], total: torch.Tensor) -> None:
    offset = 0
    for p in params:
        p.grad = total[offset : offset + p.numel()].view_as(p).to(p.dtype)
        offset += p.numel()


def forward_backward(model: nn.Module, params: list[nn.Parameter], next_batch: Callable[[], Batch],
                     loss_fn: Callable[[nn.Module, Batch, JobConfig], torch.Tensor], config: JobConfig,
                     layout: Layout, step: int,
                     compute_context: Callable[[], ContextManager]) -> torch.Tensor:
    """Run this rank's micro-batches of ``step``, leave the mean gradient over all ``layout.micro_batches``
    in ``p.grad`` of every parameter and return the mean loss (identical on every rank). ``compute_context``:
    entered around each micro-batch's forward and loss (the trainer's autocast, or a null context)."""

    def micro_batch(slot: int) -> torch.Tensor:
        batch = next_batch()
        for p in params:
            p.grad = None
        seed_micro_batch_streams(config.debug.seed, step, slot)
        with compute_context():
            loss = loss_fn(model, batch, config)
        loss.backward()
        return _flatten(params, loss)

    total = tree_sum(layout.first_slot, layout.first_slot + layout.per_rank, micro_batch)
    total = butterfly_sum(total, layout.rank, layout.world)
    total.div_(layout.micro_batches)
    _unflatten_into_grads(params, total[:-1])
    return total[-1].clone()
