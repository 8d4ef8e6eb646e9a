"""A tiny ExactResume loop (a linear model, 16 samples in batches of 2) that saves at its last step."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from torchtitan_rng import ExactResume, build_dataloader

STEPS = 2


def tiny_loop(folder: Path) -> ExactResume:
    """The loop's ExactResume, checkpointing into ``folder`` (not loaded yet)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = build_dataloader(TensorDataset(torch.arange(32.0).view(16, 2)), batch_size=2, seed=0)
    return ExactResume(folder, model=model, optimizer=optimizer, dataloader=loader, interval=STEPS, seed=0)


def train_tiny_loop(exact: ExactResume) -> None:
    """A fresh run (nothing to load) of STEPS steps, saving at the last."""
    assert exact.load() == 0
    batches = iter(exact.dataloader)
    exact.restore_rng()
    for step in range(1, STEPS + 1):
        (inputs,) = next(batches)
        exact.manager.parts["model"].model(inputs).sum().backward()
        exact.maybe_save(step, last_step=STEPS)
