"""The spike guard (``training.spike_guard``): a step whose loss or gradient norm spikes applies no update.

The decision is made on the device, from the step's 0-d loss and gradient norm, and never read by the host: a
rolling window of the last trained steps' values (float64, newest last), a mean (and standard deviation), a
threshold, a 0-d bool. The update is then applied or left out by :func:`torchtitan_rng.skips.apply_update`
with that tensor, so a guarded step costs no host synchronisation; the loss log reads the decision at its next
sync point, with the loss, and writes ``"skipped": true``. Skipped steps (decided here or listed in
``training.skip_steps``) do not enter the window: a spike does not raise the bar for the next one, and a run
that decides a skip makes the same later decisions as one that was told it.

The window is a checkpoint part (``spike_guard``), so a resumed run judges as the uninterrupted one. It is the
same on every rank: the loss and the gradient norm it sees are the step's global values.
"""

from __future__ import annotations

from typing import Any, Container

import torch

from torchtitan_rng.config import SpikeRule

class SpikeGuard:
    """One run's rolling window and its rule; :meth:`judge` once per step."""

    PART = "spike_guard"  # its checkpoint part

    def __init__(self, rule: SpikeRule, device: torch.device) -> None:
        self.rule = rule
        self.values = torch.zeros(len(rule.metrics), rule.window, dtype=torch.float64, device=device)
        self.filled = torch.zeros((), dtype=torch.int64, device=device)  # trained steps in the window

    @torch.no_grad()
    def judge(self, observed: dict[str, torch.Tensor], given: bool) -> torch.Tensor:
        """Whether this step is skipped (a 0-d bool on the device): ``given`` (training.skip_steps) or a spike
        of one of the rule's metrics in ``observed``. A trained step's values then enter the window."""
        rule, window = self.rule, self.rule.window
        value = torch.stack([observed[name].detach().reshape(()).to(torch.float64) for name in rule.metrics])
        valid = torch.arange(window, device=value.device) >= window - self.filled
        count = self.filled.clamp(min=1).to(torch.float64)
        mean = torch.where(valid, self.values, 0.0).sum(dim=1) / count
        if rule.rule == "factor":
            bar = rule.threshold * mean
        else:
            var = torch.where(valid, self.values - mean[:, None], 0.0).square().sum(dim=1) / (count - 1).clamp(min=1)
            bar = mean + rule.threshold * var.sqrt()
        spike = ~torch.isfinite(value).all() | ((self.filled >= rule.warmup) & (value > bar).any())
        skip = spike | given
        shifted = torch.cat([self.values[:, 1:], value[:, None]], dim=1)
        self.values.copy_(torch.where(skip, self.values, shifted))
        self.filled.copy_(torch.where(skip, self.filled, (self.filled + 1).clamp(max=window)))
        return skip

    def state_dict(self) -> dict[str, Any]:
        return {"values": self.values, "filled": self.filled}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.values.copy_(state_dict["values"])
        self.filled.copy_(state_dict["filled"])


def decisions(written: list[dict[str, Any]], listed: Container[int]) -> list[str]:
    """A line for each step the guard skipped among loss-log lines just written (``listed``: training.skip_steps)."""
    return [f"spike guard: step {line['step']} skipped (loss {line['loss']!r}, grad_norm {line['grad_norm']!r})"
            + ("; its samples are in the loss log" if "samples" in line else "")
            for line in written if line.get("skipped") and line["step"] not in listed]
