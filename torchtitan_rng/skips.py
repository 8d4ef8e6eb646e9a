"""Skipped steps (``training.skip_steps``): which steps apply no update, and what a resume may add.

A skipped step runs exactly as a trained one up to the update: it takes its micro-batches from the loader and
its forward and backward draw the random streams they always draw, so every later step sees the samples and
streams it would have seen; then its update is left out: the weights and the optimizer's moments stay as they
were. The learning-rate schedule and the step counters advance, the run's and the optimizer's (later steps stay
on the curve of the run without skips, and step numbers keep naming the same data). Its loss-log line holds the
loss and gradient norm it computed, with ``"skipped": true``.

Why the optimizer's count advances: the spike guard decides on the device, and torch's Adam and AdamW keep their
count on the host (it sets the bias correction there). :func:`apply_update` therefore always steps the optimizer
and puts back, with a device-side select, every tensor the step changed except that count: no host read. A
listed skip takes the same path, so a skip decided live and one given at launch are the same bits.

The mode a run trains in plays no part: both plans consume and draw inside ``forward_backward``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchtitan_rng.config import StepSet, Training, format_skip_steps, parse_skip_steps
from torchtitan_rng.errors import ConfigError

KEY = "training.skip_steps"


def skipped_steps(training: Training) -> StepSet:
    return parse_skip_steps(training.skip_steps)


def canonical(value: str) -> str:
    """The spelling a run record compares ("6, 7,9" and "6-7,9" are the same steps)."""
    return format_skip_steps(parse_skip_steps(value))


def refuse_past_steps(training: Training, saved_record: dict[str, Any] | None, checkpoint: Path, step: int) -> None:
    """A skip added at a resume for a step the checkpoint has already trained cannot be applied: refused, with
    the way to apply it (an earlier checkpoint)."""
    saved = parse_skip_steps(str(((saved_record or {}).get("config") or {}).get(KEY, "")))
    past = skipped_steps(training).minus(saved).up_to(step)  # range by range: "1-100000000" stays one range
    if past:
        raise ConfigError(f"{KEY} adds step(s) {format_skip_steps(past)}, which checkpoint {checkpoint} (step "
                          f"{step}) has already trained; leave them out, or start a new dump folder from a checkpoint "
                          "before them (--checkpoint.initial_load_path .../step-N)")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (FSDP2) tensor, in place; a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def apply_update(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """``optimizer.step()``, undone where ``skip`` (a 0-d bool, on the device or not): the weights and every state
    tensor but the step count go back to what they were (a state the step created: to zeros, the moments' start),
    selected bit for bit on the device. Costs a copy of the weights and the optimizer's state during the step."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    before = [(_local(p).clone(), {key: _local(value).clone() for key, value in optimizer.state[p].items()
                                   if key != "step" and isinstance(value, torch.Tensor)}) for p in params]
    optimizer.step()
    for p, (weights, state) in zip(params, before):
        local = _local(p)
        local.copy_(torch.where(skip, weights, local))
        for key, value in optimizer.state[p].items():
            if key == "step" or not isinstance(value, torch.Tensor):
                continue
            local = _local(value)
            local.copy_(torch.where(skip, state[key] if key in state else torch.zeros_like(local), local))
