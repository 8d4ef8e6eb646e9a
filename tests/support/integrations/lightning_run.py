"""One training run with Lightning and ExactResumeCallback (or, with --stock, a plain DataLoader and no
callback), CPU, DDP on gloo under torchrun. Writes every optimizer step's exact losses to
OUT/losses_rank{r}.txt."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader

from tests.support.integrations.common import NoisyDataset, TinyNet, record_step


class LitNet(L.LightningModule):
    def __init__(self, stock: bool, workers: int) -> None:
        super().__init__()
        self.net, self.stock, self.workers = TinyNet(), stock, workers

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net.loss(batch["x"], batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> object:
        if self.stock:
            return DataLoader(NoisyDataset(24), batch_size=2, shuffle=True, num_workers=self.workers)
        from torchtitan_rng.integrations.lightning import exact_resume_loader

        return exact_resume_loader(NoisyDataset(24), batch_size=2, seed=0, num_workers=self.workers)


class Record(L.Callback):
    def __init__(self, out: Path, signal_at: int) -> None:
        self.out, self.signal_at = out, signal_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        record_step(self.out, trainer.global_rank, trainer.global_step, pl_module.net)
        if trainer.global_step == self.signal_at and trainer.global_rank == 0:
            os.kill(os.getpid(), signal.SIGUSR1)  # a preemption notice (Lightning forwards SIGTERM to torchrun)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stock", action="store_true")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--signal-at", type=int, default=-1)
    parser.add_argument("--resume", type=Path)
    opts = parser.parse_args()

    L.seed_everything(0, verbose=False)
    callbacks: list[L.Callback] = [Record(opts.out, opts.signal_at)]
    if opts.save_every:
        callbacks.append(L.callbacks.ModelCheckpoint(dirpath=opts.out / "ckpt", every_n_train_steps=opts.save_every,
                                                     save_top_k=-1, filename="{step}"))
    if not opts.stock:
        from torchtitan_rng.integrations.lightning import ExactResumeCallback

        callbacks.append(ExactResumeCallback(opts.out / "ckpt"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                        max_steps=opts.max_steps, callbacks=callbacks, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=bool(opts.save_every),
                        default_root_dir=str(opts.out))
    trainer.fit(LitNet(opts.stock, opts.workers), ckpt_path=opts.resume)


if __name__ == "__main__":
    main()
