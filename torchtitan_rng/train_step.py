"""One optimizer step's forward and backward: ``accumulation`` micro-batches, gradients summed.

A step is an optimizer step: the trainer checkpoints, stops and logs only between two calls of
:func:`forward_backward`, so no checkpoint ever holds half an accumulation window.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn

from torchtitan_rng.config import JobConfig
from torchtitan_rng.train_spec import Batch, LossFn


def to_device(batch: dict[str, Any], device: torch.device) -> Batch:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def forward_backward(model: nn.Module, batches: Iterator[dict[str, Any]], loss_fn: LossFn, config: JobConfig,
                     accumulation: int, device: torch.device,
                     compute_context: Callable[[], ContextManager]) -> torch.Tensor:
    """Take ``accumulation`` micro-batches and backpropagate each loss scaled by 1/accumulation (the gradients
    add up to those of the mean loss); returns the mean of the micro-batch losses, detached."""
    total = torch.zeros((), device=device)
    for _ in range(accumulation):
        batch = to_device(next(batches), device)
        with compute_context():
            loss = loss_fn(model, batch, config)
        (loss / accumulation).backward()
        total += loss.detach().float()
    return total / accumulation
