"""Exact resume for the HuggingFace ``transformers.Trainer`` (extra ``hf``: transformers 5.23, accelerate 1.15).

``ExactResumeTrainer`` is the Trainer with three changes:

* its train loader is an :class:`~torchtitan_rng.integrations.loader.EpochLoader` (not passed through
  accelerate, so no ``DataLoaderShard`` reading a batch ahead; a generator of its own, so starting an
  epoch draws nothing from the global streams; workers whose streams are checkpointed);
* every checkpoint holds, per process, ``exact_resume_rank{r}.pt``: the loader position and that
  process's global streams (Python, NumPy, torch CPU, its accelerator) at the step boundary. A resumed
  run loads it instead of skipping batches, and the streams go back right before the first batch of the
  resumed epoch is fetched (the stock Trainer restores them after fetching it);
* SIGTERM / SIGUSR1 set a flag; at the next optimizer step all processes agree (one all-reduce), save a
  checkpoint at that step and stop.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers
from torch.utils.data import IterableDataset

from torchtitan_rng.distributed import StopVote
from torchtitan_rng.integrations import check_tested_version
from torchtitan_rng.integrations.loader import EpochLoader, exact_resume_loader
from torchtitan_rng import signals

check_tested_version("transformers")
check_tested_version("accelerate")

STATE_FILE = "exact_resume_rank{rank}.pt"


class _SaveAndStopOnSignal(transformers.TrainerCallback):
    """After each optimizer step: if any process got a checkpoint signal, all save and stop at the same step
    (the one after the signal's with several processes: the vote never waits)."""

    def __init__(self) -> None:
        self.vote: StopVote | None = None

    def on_train_begin(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                       control: transformers.TrainerControl, **kwargs: Any) -> None:
        self.vote = StopVote()  # every process starts training here, with its process group up

    def on_step_end(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                    control: transformers.TrainerControl, **kwargs: Any) -> None:
        if self.vote is not None and self.vote.poll(signals.received() is not None):
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                     control: transformers.TrainerControl, **kwargs: Any) -> None:
        if self.vote is not None:
            self.vote.close()  # every process has one vote in flight
        self.vote = None


class ExactResumeTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose runs resume bit for bit; same constructor and ``train()``.

    Needs a map-style ``train_dataset`` and checkpoints with optimizer state (``save_only_model=False``).
    The sampler's permutation per epoch derives from ``args.data_seed`` (or ``args.seed``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.args.save_only_model:
            raise ValueError("ExactResumeTrainer needs save_only_model=False: a checkpoint without optimizer "
                             "and loader state cannot resume exactly")
        signals.install()
        self.add_callback(_SaveAndStopOnSignal())
        self._exact_loader: EpochLoader | None = None

    def get_train_dataloader(self) -> EpochLoader:  # type: ignore[override]
        dataset = self.train_dataset
        if dataset is None or isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise ValueError("ExactResumeTrainer needs a map-style train_dataset (with __len__ and __getitem__)")
        collator = self.data_collator
        if hasattr(dataset, "column_names"):  # a datasets.Dataset: drop the columns forward() does not take
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        if self._exact_loader is not None:
            self._exact_loader.close()
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        self._exact_loader = exact_resume_loader(
            dataset, batch_size=self._train_batch_size, seed=seed, num_workers=self.args.dataloader_num_workers,
            collate_fn=collator, prefetch_factor=self.args.dataloader_prefetch_factor or 2, device=self.args.device,
        )
        return self._exact_loader

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            if self._exact_loader is not None:
                self._exact_loader.close()

    def _run_epoch(self, **kwargs: Any) -> Any:
        """The resumed epoch: load the loader and streams, then run only the batches the epoch has left
        (instead of the stock skip, which rebuilds the loader and fetches before restoring the streams)."""
        checkpoint = kwargs["resume_from_checkpoint"]
        if checkpoint is not None and kwargs["epoch"] == kwargs["epochs_trained"]:
            assert self._exact_loader is not None
            self._exact_loader.load_state_dict(self._read_rank_state(checkpoint))
            accumulation = self.args.gradient_accumulation_steps
            done = (self.state.global_step % kwargs["num_update_steps_per_epoch"]) * accumulation
            kwargs.update(
                resume_from_checkpoint=None,
                steps_trained_in_current_epoch=0,
                steps_in_epoch=kwargs["steps_in_epoch"] - done,
                num_update_steps_per_epoch=kwargs["num_update_steps_per_epoch"] - done // accumulation,
            )
        return super()._run_epoch(**kwargs)

    def _save_rng_state(self, output_dir: str) -> None:
        """Called by every process at each checkpoint: its loader position and streams, in its own file."""
        if self._exact_loader is None:
            return
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, STATE_FILE.format(rank=self.args.process_index))
        torch.save(self._exact_loader.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)

    def _read_rank_state(self, checkpoint: str) -> dict[str, Any]:
        path = os.path.join(checkpoint, STATE_FILE.format(rank=self.args.process_index))
        if not os.path.isfile(path):
            raise ValueError(
                f"{checkpoint} has no {os.path.basename(path)}: it was not written by ExactResumeTrainer with "
                f"{self.args.world_size} process(es); resume it with that many processes, or with the stock Trainer"
            )
        return torch.load(path, weights_only=True)
