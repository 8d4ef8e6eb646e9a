"""What the integration scripts share: a dataset whose samples draw from all three global RNGs, a tiny
model with dropout, and the exact per-micro-batch loss record (float.hex, one line per optimizer step)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

FEATURES = 8


class NoisyDataset(Dataset):
    """Fixed inputs plus noise drawn in ``__getitem__`` from ``random``, ``numpy.random`` and ``torch``."""

    def __init__(self, size: int) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(size, FEATURES, generator=gen)
        self.y = torch.randn(size, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        noise = torch.rand(FEATURES) * 0.1 + float(np.random.rand()) * 0.1 + random.random() * 0.1
        return {"x": self.x[index] + noise, "labels": self.y[index]}


class TinyNet(nn.Module):
    """Linear, dropout, linear; keeps the loss of every training forward for the record."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, 16), nn.Dropout(0.5), nn.Linear(16, 1))
        self.recorded: list[float] = []

    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.body(x), labels)
        if self.training:
            self.recorded.append(float(loss.detach()))
        return loss


def record_step(out: Path, rank: int, step: int, model: TinyNet) -> None:
    """Append ``step`` and the exact losses of its micro-batches to this rank's record."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"losses_rank{rank}.txt", "a") as f:
        f.write(f"{step} {' '.join(value.hex() for value in model.recorded)}\n")
    model.recorded.clear()
