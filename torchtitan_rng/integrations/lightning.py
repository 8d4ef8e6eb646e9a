"""Exact resume for PyTorch Lightning (extra ``lightning``: lightning 2.6, ``import lightning.pytorch as L``).

Two changes to a user's script: ``train_dataloader()`` returns :func:`exact_resume_loader` (a loader with
a saved position, its own generator and checkpointed worker streams; Lightning reads no batch ahead of a
loader whose length it knows), and ``ExactResumeCallback()`` joins the Trainer's callbacks:

* at every checkpoint each rank's loader state (position and that rank's global streams at the step
  boundary) is gathered into the file rank 0 writes; Lightning alone would save rank 0's and load it on
  every rank;
* on resume each rank gets its own back; Lightning loads it into the loader before the epoch's iterator
  is created, and the streams go back right before the first batch is fetched;
* SIGTERM / SIGUSR1 set a flag; after the next optimizer step all ranks agree (one all-reduce), save a
  checkpoint at that step and stop (Lightning alone stops without saving).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch.distributed as dist

from torchtitan_rng.distributed import StopVote, rank_and_world_size
from torchtitan_rng.integrations import check_tested_version
from torchtitan_rng.integrations.loader import EpochLoader, exact_resume_loader
from torchtitan_rng import signals

check_tested_version("lightning")

__all__ = ["ExactResumeCallback", "exact_resume_loader"]

CHECKPOINT_KEY = "torchtitan_rng_loader_by_rank"


def _fit_loop_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    return checkpoint["loops"]["fit_loop"]["state_dict"]


class ExactResumeCallback(L.Callback):
    """Per-rank loader state and streams in every checkpoint, and a save at the agreed step on a signal.

    Args:
        dirpath: where the signal-triggered checkpoint goes (``preempted-step=N.ckpt``); default
            ``<default_root_dir>/checkpoints``. Resume with ``trainer.fit(..., ckpt_path=that file)``.
    """

    def __init__(self, dirpath: str | Path | None = None) -> None:
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self._loaders: list[EpochLoader] = []
        self._vote: StopVote | None = None
        signals.install()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        mine = _fit_loop_state(checkpoint).get("combined_loader")
        if not mine:
            raise ValueError("ExactResumeCallback needs train_dataloader() to return "
                             "torchtitan_rng.integrations.lightning.exact_resume_loader(...)")
        _, world = rank_and_world_size()
        by_rank: list[Any] = [mine]
        if world > 1:  # a collective: Lightning builds the checkpoint on every rank, rank 0 writes it
            by_rank = [None] * world
            dist.all_gather_object(by_rank, mine)
        checkpoint[CHECKPOINT_KEY] = by_rank

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        by_rank = checkpoint.get(CHECKPOINT_KEY)
        rank, world = rank_and_world_size()
        if by_rank is None:
            raise ValueError("this checkpoint was saved without ExactResumeCallback: it holds no per-rank loader "
                             "state; resume it without the callback (inexactly) or from one saved with it")
        if len(by_rank) != world:
            raise ValueError(f"this checkpoint holds the loaders of {len(by_rank)} ranks and this run has {world}: "
                             f"resume with {len(by_rank)} processes for an exact resume")
        # Lightning loads this list into the train loader before creating its iterator: give it this rank's.
        _fit_loop_state(checkpoint)["combined_loader"] = by_rank[rank]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        signalled = signals.received() is not None or trainer.received_sigterm
        # At optimizer steps only, the same ones on every rank; the vote is read one step later, never waited for.
        if trainer.fit_loop._should_accumulate() or self._vote is None or not self._vote.poll(signalled):
            return
        folder = self.dirpath or Path(trainer.default_root_dir) / "checkpoints"
        trainer.save_checkpoint(folder / f"preempted-step={trainer.global_step}.ckpt")
        trainer.should_stop = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._loaders = _epoch_loaders(trainer)  # kept for teardown, when Lightning has let go of them
        self._vote = StopVote()  # every rank starts training here, with its process group up

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._vote is not None:
            self._vote.close()  # every rank has one vote in flight
        self._vote = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._vote = None  # another rank may never cast the vote in flight: not waited for
        self._loaders += _epoch_loaders(trainer)
        self.teardown(trainer, pl_module, "fit")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # The loader's workers ignore the checkpoint signals, so exit-time termination cannot end them.
        for loader in self._loaders:
            loader.close()
        self._loaders = []


def _epoch_loaders(trainer: L.Trainer) -> list[EpochLoader]:
    combined = trainer.fit_loop._combined_loader
    return [it for it in (combined.flattened if combined is not None else []) if isinstance(it, EpochLoader)]
