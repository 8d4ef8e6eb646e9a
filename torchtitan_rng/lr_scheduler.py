"""Linear warmup, then linear/cosine decay (or constant) planned over ``lr_scheduler.total_steps``."""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def _schedule(config: JobConfig) -> WarmupDecay:
    return WarmupDecay(
        warmup_steps=config.lr_scheduler.warmup_steps,
        total_steps=lr_total_steps(config),
        decay_type=config.lr_scheduler.decay_type,
        min_lr_factor=config.lr_scheduler.min_lr_factor,
    )


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: JobConfig) -> LambdaLR:
    return LambdaLR(optimizer, _schedule(config))


def schedule_from_config(scheduler: LambdaLR, config: JobConfig) -> None:
    """After a load: the schedule and base learning rate are the config's, the position (step) the
    checkpoint's. A loaded LambdaLR carries the saved schedule's fields and base_lrs; a resume allowed to
    change them (checkpoint.allow_config_change) must not silently keep the old ones. Unchanged, every value
    set here is the one already there, bit for bit (the lr is the same product LambdaLR computes)."""
    schedule = _schedule(config)
    scheduler.lr_lambdas = [schedule for _ in scheduler.optimizer.param_groups]
    scheduler.base_lrs = [config.optimizer.lr for _ in scheduler.optimizer.param_groups]
    for group in scheduler.optimizer.param_groups:
        group["initial_lr"] = config.optimizer.lr
        group["lr"] = config.optimizer.lr * schedule(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]  # get_last_lr() reads it
