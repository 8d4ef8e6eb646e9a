"""ExactResumeCallback in one process: a train loader it refuses fails fit() without leaving Lightning's
DataLoader patching in place (Lightning undoes it only when the loader request returns normally), so a later
Trainer of the same process pickles after training as a stock one does; ``ckpt_path="last"`` after a
preemption resumes it, or the fit that does not says so."""

from __future__ import annotations

import io
import os
import signal
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
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


class _Preempt(L.Callback):
    """SIGTERM to this process after optimizer step ``at`` (-1: never), as a preemption notice arrives; notes the
    step each fit() starts from."""

    def __init__(self, at: int = -1) -> None:
        self.at, self.started_at = at, -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started_at = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def _fit_from(folder: Path, ckpt_path: str | None, *, keep_last: bool, at: int = -1) -> tuple[int, ExactResumeCallback]:
    """A fit() of 6 steps with the callback saving into ``folder`` (and a ModelCheckpoint keeping a last file
    there, ``keep_last``): the step it started from, and the callback."""
    exact, preempt = ExactResumeCallback(folder), _Preempt(at)
    keepers = [ModelCheckpoint(dirpath=folder, save_last=True, every_n_train_steps=1000)] if keep_last else []
    trainer = L.Trainer(accelerator="cpu", max_steps=6, logger=False, enable_checkpointing=keep_last,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[exact, preempt, *keepers])
    loader = DataLoader(NoisyDataset(24), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    trainer.fit(Net(loader), ckpt_path=ckpt_path)
    return preempt.started_at, exact


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_last_after_a_preemption_resumes_it_or_is_named(tmp_path: Path, recwarn: pytest.WarningsRecorder) -> None:
    """Preempted by SIGTERM at step 2 (saved at 3). With a ModelCheckpoint keeping a last file (saved at the end
    of the stopped fit), ``fit(ckpt_path="last")`` resumes at step 3, as the docs say. Without one, ``"last"``
    finds nothing (Lightning's rule) and the fit that trains from step 1 names the preempted checkpoint in one
    warning; control: a fit in an empty folder says nothing of it."""
    kept = tmp_path / "kept"
    started, exact = _fit_from(kept, None, keep_last=True, at=2)
    assert started == 0 and exact.preempted_checkpoint == kept / "preempted-step=3.ckpt"
    assert _fit_from(kept, "last", keep_last=True)[0] == 3
    alone = tmp_path / "alone"
    _fit_from(alone, None, keep_last=False, at=2)
    recwarn.clear()
    assert _fit_from(alone, "last", keep_last=False)[0] == 0
    named = [str(w.message) for w in recwarn if "holds a preempted run" in str(w.message)]
    assert named == [f"{alone / 'preempted-step=3.ckpt'} holds a preempted run and this fit() loaded no checkpoint: "
                     f"it trains from step 1; to resume it pass ckpt_path=\"{alone / 'preempted-step=3.ckpt'}\" "
                     "(ckpt_path=\"last\" finds it only through a ModelCheckpoint(save_last=True))"]
    recwarn.clear()
    _fit_from(tmp_path / "empty", None, keep_last=False)
    assert not [w for w in recwarn if "holds a preempted run" in str(w.message)]
