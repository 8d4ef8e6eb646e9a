"""Progress lines: step, loss, lr, throughput, time per step, memory and an estimate of time left."""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import torch

from torchtitan_rng import device as device_lib


def _memory(device: torch.device) -> str:
    if device.type != "cpu":
        return f"mem {device_lib.memory_allocated_bytes(device) / 2**30:.2f} GiB"
    # On the CPU the model lives in process memory: report this process's peak resident size.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_bytes = peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
    return f"peak rss {peak_bytes / 2**30:.2f} GiB"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class ProgressReporter:
    """One line every ``log_freq`` steps and at the last step, on rank 0. Time per step and throughput are
    over the steps since the previous line; the time left is from the mean step time of this run so far
    (checkpoint saves included), which a single slow interval does not swing."""

    def __init__(self, *, log_freq: int, last_step: int, items_per_step: int, unit: str,
                 device: torch.device, enabled: bool) -> None:
        self.log_freq = log_freq
        self.last_step = last_step
        self.items_per_step = items_per_step
        self.unit = unit
        self.device = device
        self.enabled = enabled
        self._start = self._since = time.perf_counter()
        self._steps_since = 0
        self._steps_total = 0

    def step_done(self, step: int, record: dict[str, Any]) -> None:
        """Count a finished step; print a line for it when due (``record``: its loss-log record)."""
        self._steps_since += 1
        self._steps_total += 1
        if not self.enabled or (step % self.log_freq and step != self.last_step):
            return
        now = time.perf_counter()
        seconds_per_step = (now - self._since) / self._steps_since
        throughput = self.items_per_step / seconds_per_step if seconds_per_step > 0 else 0.0
        time_left = (now - self._start) / self._steps_total * (self.last_step - step)
        validation = f"  val_loss {record['val_loss']:.6f}" if "val_loss" in record else ""
        print(
            f"step {step:>5}  loss {record['loss']:.6f}{validation}  lr {record['lr']:.3e}  "
            f"{throughput:,.0f} {self.unit}/s  "
            f"{seconds_per_step * 1000:.1f} ms/step  {_memory(self.device)}  eta {_duration(time_left)}",
            flush=True,
        )
        self._since, self._steps_since = now, 0
