"""One training run with Lightning and ExactResumeCallback (or, with --stock, a plain DataLoader and no
callback), CPU, DDP on gloo under torchrun. Writes every optimizer step's exact losses to
OUT/losses_rank{r}.txt; validation (--val-every) draws from the global streams as a user's would."""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, SubsetRandomSampler

from tests.support.integrations.common import NoisyDataset, TinyNet, record_step


class LitNet(L.LightningModule):
    def __init__(self, loader: str, workers: int) -> None:
        super().__init__()
        self.net, self.loader, self.workers = TinyNet(), loader, workers

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net.loss(batch["x"], batch["labels"])

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        torch.rand(1)  # a user's validation may draw, e.g. for a noisy metric
        self.log("val_loss", self.net.loss(batch["x"], batch["labels"]), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> object:
        if self.loader == "stock":
            return DataLoader(NoisyDataset(24), batch_size=2, shuffle=True, num_workers=self.workers)
        if self.loader == "plain":  # the callback makes it an exact loader, seeded from its generator's seed
            return DataLoader(NoisyDataset(24), batch_size=2, shuffle=True, num_workers=self.workers,
                              generator=torch.Generator().manual_seed(0))
        if self.loader == "custom-sampler":  # an order the callback cannot carry over: refused
            return DataLoader(NoisyDataset(24), batch_size=2, sampler=SubsetRandomSampler(range(24)))
        from torchtitan_rng.integrations.lightning import exact_resume_loader

        return exact_resume_loader(NoisyDataset(24), batch_size=2, seed=0, num_workers=self.workers)

    def val_dataloader(self) -> DataLoader:  # no generator of its own: iterating it draws from torch's
        return DataLoader(NoisyDataset(4), batch_size=2)


class Record(L.Callback):
    """The losses of each optimizer step; at --pause-at (and --pause-micro: one micro-batch later) the ranks of
    --pause-ranks write their pid to OUT/paused_rank{r} and wait for the test's signal."""

    def __init__(self, out: Path, opts: argparse.Namespace) -> None:
        self.out, self.pause_at, self.pause_micro = out, opts.pause_at, opts.pause_micro
        self.pause_ranks, self.signal_self_at, self.usr1_at = set(opts.pause_ranks), opts.signal_self_at, opts.signal_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        accumulating = trainer.fit_loop._should_accumulate()
        if not accumulating:
            record_step(self.out, trainer.global_rank, trainer.global_step, pl_module.net)
            if trainer.global_step == self.usr1_at and trainer.global_rank == 0:
                os.kill(os.getpid(), signal.SIGUSR1)  # a preemption notice to rank 0 (SLURM's --signal=USR1@90)
        elif trainer.global_step == self.signal_self_at:  # a signal in the middle of an accumulation window
            os.kill(os.getpid(), signal.SIGTERM)
        if (trainer.global_step == self.pause_at and accumulating == self.pause_micro
                and trainer.global_rank in self.pause_ranks):
            from torchtitan_rng import signals

            (self.out / f"paused_rank{trainer.global_rank}").write_text(str(os.getpid()))
            while signals.received() is None:  # the test signals once it reads the file
                time.sleep(0.01)


class UserStop(L.Callback):
    """A user's own stop: save a checkpoint at step N and stop."""

    def __init__(self, out: Path, at: int) -> None:
        self.out, self.at = out, at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == self.at and not trainer.fit_loop._should_accumulate():
            trainer.save_checkpoint(self.out / "ckpt" / f"user-step={self.at}.ckpt")
            trainer.should_stop = True


def fit(opts: argparse.Namespace, out: Path, resume: Path | None) -> None:
    L.seed_everything(0, verbose=False)
    callbacks: list[L.Callback] = [Record(out, opts)]
    if opts.user_stop:
        callbacks.append(UserStop(out, opts.user_stop))
    if opts.save_every:
        callbacks.append(L.callbacks.ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=opts.save_every,
                                                     save_top_k=-1, filename="{step}"))
    if not opts.stock:
        from torchtitan_rng.integrations.lightning import ExactResumeCallback

        if opts.no_val_fork:  # the control: the callback without validation under preserved streams
            class ExactResumeCallback(ExactResumeCallback):  # type: ignore[no-redef]
                def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
                    super().on_train_start(trainer, pl_module)
                    val_loop = trainer.fit_loop.epoch_loop.val_loop
                    val_loop.run = val_loop.run.run  # the stock validation loop, which moves the streams

        callbacks.append(ExactResumeCallback(out / "ckpt"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    validation = {"val_check_interval": opts.val_every, "check_val_every_n_epoch": None, "num_sanity_val_steps": 0}
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                        max_steps=opts.max_steps, callbacks=callbacks, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=bool(opts.save_every),
                        accumulate_grad_batches=opts.ga, default_root_dir=str(out),
                        **(validation if opts.val_every else {"limit_val_batches": 0}))
    trainer.fit(LitNet("stock" if opts.stock else opts.loader, opts.workers), ckpt_path=resume)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stock", action="store_true")
    parser.add_argument("--loader", choices=("exact", "plain", "custom-sampler"), default="exact",
                        help="what train_dataloader() returns beside the callback")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--ga", type=int, default=1)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--val-every", type=int, default=0, help="validate every N batches")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--user-stop", type=int, default=0)
    parser.add_argument("--pause-at", type=int, default=-1)
    parser.add_argument("--pause-micro", action="store_true")
    parser.add_argument("--pause-ranks", type=int, nargs="*", default=[0])
    parser.add_argument("--signal-at", type=int, default=-1, help="SIGUSR1 to rank 0 at the end of this step")
    parser.add_argument("--signal-self-at", type=int, default=-1, help="SIGTERM to itself mid-accumulation")
    parser.add_argument("--no-val-fork", action="store_true")
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--again", type=Path, help="then a second fit() in this process, into this folder")
    parser.add_argument("--sigterm-after", action="store_true", help="then SIGTERM to itself, outside training")
    opts = parser.parse_args()

    fit(opts, opts.out, opts.resume)
    if opts.again:
        opts.pause_at = opts.signal_self_at = opts.signal_at = -1
        fit(opts, opts.again, None)
    if opts.sigterm_after:
        os.kill(os.getpid(), signal.SIGTERM)
        (opts.out / "survived_sigterm").write_text("")


if __name__ == "__main__":
    main()
