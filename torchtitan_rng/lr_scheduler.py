"""Linear warmup, then linear/cosine decay (or constant) planned over ``lr_scheduler.total_steps``.

The config is the truth for the schedule: a checkpoint holds only how far the schedule has gone (torch's
``LambdaLR.state_dict`` would also save the schedule's fields, and loading them would silently replace
the config's ``total_steps``, ``warmup_steps`` and decay with the checkpoint's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from torchtitan_rng.config import JobConfig, lr_total_steps


@dataclass(frozen=True)
class WarmupDecay:
    """The lr factor of a step; a plain object (not a closure) so the schedule is easy to read and test."""

    warmup_steps: int
    total_steps: int
    decay_type: str
    min_lr_factor: float

    def __call__(self, scheduler_step: int) -> float:
        step = scheduler_step + 1  # LambdaLR counts from 0; training steps count from 1
        if step <= self.warmup_steps:
            return step / (self.warmup_steps + 1)
        if self.decay_type == "constant":
            return 1.0
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        shape = 1.0 - progress if self.decay_type == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_factor + (1.0 - self.min_lr_factor) * shape


class ConfiguredLR(LambdaLR):
    """A LambdaLR whose checkpoint is its step counter only; loading it sets the optimizer's lr from the
    config's schedule at that step (load it after the optimizer, whose saved lr it replaces)."""

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = self.last_epoch + 1  # as after that many step() calls
        lrs = [base_lr * factor(self.last_epoch) for base_lr, factor in zip(self.base_lrs, self.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = lrs


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: JobConfig) -> ConfiguredLR:
    schedule = WarmupDecay(
        warmup_steps=config.lr_scheduler.warmup_steps,
        total_steps=lr_total_steps(config),
        decay_type=config.lr_scheduler.decay_type,
        min_lr_factor=config.lr_scheduler.min_lr_factor,
    )
    return ConfiguredLR(optimizer, schedule)
