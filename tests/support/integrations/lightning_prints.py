"""One Lightning run with ExactResumeCallback(tensor_fingerprint=True), and a fault to inject: the tensor
locator's e2e runs.

    python -m tests.support.integrations.lightning_prints --out DIR --max-steps N [--resume CKPT] [--data-seed S]
        [--noisy] [--clip X]

A small regressor with dropout; rank 0 appends each optimizer step's loss to ``DIR/loss_log.jsonl`` and the
fingerprints go beside it; a checkpoint at the last step in ``DIR/ckpt/last.ckpt``, which ``--resume`` loads.
Faults: ``--data-seed`` another sample order; ``--noisy`` noise from an OS-seeded generator on the first layer's
output; ``--clip`` another ``gradient_clip_val`` (at a resume).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchtitan_rng.integrations.lightning import ExactResumeCallback
from tests.support.divergences import make_noisy


class Regressor(L.LightningModule):
    def __init__(self, data_seed: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 1))
        self.data_seed = data_seed

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.body(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(48, 8, generator=generator), torch.randn(48, 1, generator=generator))
        return DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(self.data_seed))


class LossLog(L.Callback):
    def __init__(self, out: Path) -> None:
        self.path = out / "loss_log.jsonl"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_rank == 0:
            with self.path.open("a") as log:
                log.write(json.dumps({"step": trainer.global_step, "loss": float(outputs["loss"])}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--noisy", action="store_true")
    parser.add_argument("--clip", type=float, default=0.05)
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    model = Regressor(opts.data_seed)
    if opts.noisy:
        make_noisy(model.body[0])
    save = L.callbacks.ModelCheckpoint(dirpath=opts.out / "ckpt", save_last=True, save_top_k=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=opts.max_steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        gradient_clip_val=opts.clip, default_root_dir=str(opts.out),
                        callbacks=[LossLog(opts.out), save,
                                   ExactResumeCallback(tensor_fingerprint=True, fingerprint_modules_at_step=1)])
    trainer.fit(model, ckpt_path=opts.resume)


if __name__ == "__main__":
    main()
