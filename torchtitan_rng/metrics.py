"""Progress lines: step, loss, lr, throughput, time per step, memory and an estimate of time left."""

from __future__ import annotations

import time

import torch

from torchtitan_rng import device as device_lib


class ProgressReporter:
    def __init__(self, *, log_freq: int, last_step: int, items_per_step: int, unit: str,
                 device: torch.device, enabled: bool) -> None:
        self.log_freq = log_freq
        self.last_step = last_step
        self.items_per_step = items_per_step
        self.unit = unit
        self.device = device
        self.enabled = enabled
        self._since = time.perf_counter()
        self._steps_since = 0

    def step_done(self, step: int, loss: float, lr: float) -> None:
        self._steps_since += 1
        if not self.enabled or (step % self.log_freq and step != self.last_step):
            return
        now = time.perf_counter()
        seconds_per_step = (now - self._since) / self._steps_since
        throughput = self.items_per_step / seconds_per_step if seconds_per_step > 0 else 0.0
        memory_gib = device_lib.memory_allocated_bytes(self.device) / 2**30
        eta = seconds_per_step * (self.last_step - step)
        print(
            f"step {step:>5}  loss {loss:.6f}  lr {lr:.3e}  {throughput:,.0f} {self.unit}/s  "
            f"{seconds_per_step * 1000:.1f} ms/step  mem {memory_gib:.2f} GiB  eta {eta:.0f}s",
            flush=True,
        )
        self._since, self._steps_since = now, 0
