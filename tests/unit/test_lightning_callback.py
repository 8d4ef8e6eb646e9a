"""ExactResumeCallback in one process: a train loader it refuses fails fit() without leaving Lightning's
DataLoader patching in place (Lightning undoes it only when the loader request returns normally), so a later
Trainer of the same process pickles after training as a stock one does."""

from __future__ import annotations

import io

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader, SubsetRandomSampler

from tests.support.integrations.common import NoisyDataset, TinyNet
from torchtitan_rng.errors import ConfigError
from torchtitan_rng.integrations.lightning import ExactResumeCallback


class Net(L.LightningModule):
    def __init__(self, loader: DataLoader) -> None:
        super().__init__()
        self.net, self.loader = TinyNet(), loader

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net.loss(batch["x"], batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return self.loader


def _fit(loader: DataLoader) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[ExactResumeCallback()])
    trainer.fit(Net(loader))
    return trainer


def test_a_trainer_pickles_after_a_refused_loader_in_the_same_process() -> None:
    # A sampler of its own: an order the callback cannot carry over.
    with pytest.raises(ConfigError, match="no sampler of its own"):
        _fit(DataLoader(NoisyDataset(8), batch_size=2, sampler=SubsetRandomSampler(range(8))))
    trainer = _fit(DataLoader(NoisyDataset(8), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0)))
    assert trainer.global_step == 2
    torch.save(trainer, io.BytesIO())
