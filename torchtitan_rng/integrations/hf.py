"""Exact resume for the HuggingFace ``transformers.Trainer`` (extra ``hf``: transformers 5.23, accelerate 1.15).

``ExactResumeTrainer`` is the Trainer with these changes:

* its train loader is an :class:`~torchtitan_rng.integrations.loader.EpochLoader` (not passed through
  accelerate, so no ``DataLoaderShard`` reading a batch ahead; a generator of its own, so starting an
  epoch draws nothing from the global streams; workers whose streams are checkpointed);
* every checkpoint holds, per process, ``exact_resume_rank{r}.pt``: the loader position and that
  process's global streams (Python, NumPy, torch CPU, its accelerator) at the step boundary. A resumed
  run loads it instead of skipping batches, and the streams go back right before the first batch of the
  resumed epoch is fetched (the stock Trainer restores them after fetching it);
* evaluation runs under preserved streams: evaluating at a step (an ``eval_steps`` step, the evaluation
  at the end of ``max_steps``) moves no training stream, so a checkpoint saved after it resumes exactly;
* during ``train()`` only, SIGTERM / SIGUSR1 set a flag; at the next optimizer step all processes agree
  (one all-reduce), save a checkpoint at that step and stop, saying so in one line; ``trainer.stopped_by`` is
  then the signal's name (None after a ``train()`` that ran to its end). The handlers found before ``train()`` are
  back after it. This trainer is the one owner of SIGTERM: with ``enable_jit_checkpoint=True`` the stock
  JIT checkpoint's SIGTERM handler (which saves in the middle of a step, on each process on its own) is
  taken back; its callback stays, inert;
* ``train(resume_from_checkpoint=True)`` starts afresh, with one line, when ``output_dir`` holds no checkpoint
  yet (the stock Trainer raises): one job script serves the first launch and every resumption;
* with ``tensor_fingerprint=True``, per optimizer step and process, hashes of each micro-batch, its loss, the
  gradients before clipping, the parameters after the update (the optimizer state too where a checkpoint is
  saved), and the state a resume loaded, in ``dump_folder/tensor_fingerprints/`` (docs/diagnosis.md):
  ``compare_losses`` names the first tensor that differs between two runs.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import torch
import transformers
from torch.utils.data import IterableDataset
from transformers.trainer_jit_checkpoint import JITCheckpointCallback
from transformers.trainer_utils import get_last_checkpoint

from torchtitan_rng import signals
from torchtitan_rng.config import Debug
from torchtitan_rng.diagnosis.tensor_fingerprints import TensorFingerprints
from torchtitan_rng.distributed import StopVote
from torchtitan_rng.errors import ConfigError
from torchtitan_rng.integrations import check_tested_version
from torchtitan_rng.integrations.loader import EpochLoader, exact_resume_loader
from torchtitan_rng.rng import preserved_global_rng

check_tested_version("transformers")
check_tested_version("accelerate")

STATE_FILE = "exact_resume_rank{rank}.pt"
SAMPLING_STRATEGIES = {"random": True, "sequential": False}  # train_sampling_strategy -> shuffle
log = logging.getLogger(__name__)


class _ExactResumeCallback(transformers.TrainerCallback):
    """After each optimizer step: the logged epoch of a resumed epoch as the uninterrupted run logs it; if any
    process got a checkpoint signal, all save and stop at the same step (the one after the signal's with
    several processes: the vote never waits)."""

    def __init__(self) -> None:
        self.vote: StopVote | None = None
        self.stopping = False
        self.stopped_by: str | None = None  # the signal the last train() stopped for, once its checkpoint is saved
        # (epoch, optimizer steps per epoch, micro-batches per epoch) while in a resumed epoch.
        self.resumed_epoch: tuple[int, int, int] | None = None

    def on_train_begin(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                       control: transformers.TrainerControl, **kwargs: Any) -> None:
        self.vote = StopVote()  # every process starts training here, with its process group up
        self.stopping = False
        self.stopped_by = None

    def on_step_end(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                    control: transformers.TrainerControl, **kwargs: Any) -> None:
        if self.resumed_epoch is not None:
            # The stock formula, epoch + micro-batches done / per epoch, counting those before the resume.
            epoch, updates, batches = self.resumed_epoch
            done = min((state.global_step - epoch * updates) * args.gradient_accumulation_steps, batches)
            state.epoch = epoch + done / batches
        if self.vote is not None and self.vote.poll(signals.received() is not None):
            self.vote.close()  # the vote cast with it: the same signal, acted on now
            self.vote = None
            self.stopping = control.should_save = control.should_training_stop = True

    def on_epoch_end(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                     control: transformers.TrainerControl, **kwargs: Any) -> None:
        self.resumed_epoch = None

    def on_save(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                control: transformers.TrainerControl, **kwargs: Any) -> None:
        if self.stopping:
            self.stopped_by = signals.received() or "a signal to another process"
            signals.acknowledge()
            if args.process_index == 0:
                log.warning("stopped by %s at step %d: checkpoint-%d saved in %s; train(resume_from_checkpoint=True) "
                            "resumes it", self.stopped_by, state.global_step, state.global_step, args.output_dir)

    def on_train_end(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                     control: transformers.TrainerControl, **kwargs: Any) -> None:
        # A signal voted on at the last step stays unacknowledged: train() ends by delivering it again.
        if self.vote is not None:
            self.vote.close()  # every process has one vote in flight
        self.vote = None
        self.resumed_epoch = None


# TrainingArguments that say where a run writes and logs, not what it trains: not compared between runs.
_WHERE = ("dir", "hub_", "run_name", "logging_", "report_to", "save_", "push_to_hub", "resume_from_checkpoint")


class _Fingerprints(transformers.TrainerCallback):
    """``tensor_fingerprint``: the recorder, built at the first step (the optimizer exists then, and a resume has
    loaded); each optimizer step begins it, its end records the update, a save writes what is queued."""

    def __init__(self, trainer: transformers.Trainer, debug: Debug, dump_folder: str | Path | None) -> None:
        self.trainer, self.debug, self.dump_folder = trainer, debug, dump_folder
        self.prints: TensorFingerprints | None = None

    def on_step_begin(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                      control: transformers.TrainerControl, **kwargs: Any) -> None:
        if self.prints is None:
            config = json.loads(json.dumps({f"args.{key}": value for key, value in args.to_dict().items()
                                            if not any(part in key for part in _WHERE)}, default=repr))
            self.prints = TensorFingerprints(
                self.debug, self.trainer.model, self.trainer.optimizer, rank=args.process_index,
                world_size=args.world_size,
                dump_folder=Path(self.dump_folder if self.dump_folder is not None else args.output_dir),
                config=config)
        self.prints.step_begin(state.global_step + 1)

    def on_pre_optimizer_step(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                              control: transformers.TrainerControl, **kwargs: Any) -> None:
        if self.prints is not None and "grad" not in self.prints.record:  # max_grad_norm 0: nothing clipped
            self.prints.gradients()

    def on_step_end(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                    control: transformers.TrainerControl, **kwargs: Any) -> None:
        if self.prints is not None:
            self.prints.updated(flush=False)

    def on_save(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                control: transformers.TrainerControl, **kwargs: Any) -> None:
        if self.prints is not None:
            self.prints.saving(state.global_step)  # with the optimizer state the checkpoint holds

    def on_train_end(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                     control: transformers.TrainerControl, **kwargs: Any) -> None:
        if self.prints is not None:
            self.prints.close()
            self.prints = None


class ExactResumeTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose runs resume bit for bit; same constructor and ``train()``.

    Needs a map-style ``train_dataset`` and checkpoints with optimizer state (``save_only_model=False``).
    The sampler's permutation per epoch derives from ``args.data_seed`` (or ``args.seed``);
    ``train_sampling_strategy`` ``"random"`` or ``"sequential"``.

    Keyword arguments beyond the Trainer's:
        on_stock_checkpoint: ``"error"`` (default): a checkpoint written by the stock Trainer is refused;
            ``"warn"``: it is resumed once, inexactly (its global streams, the loader at its step, fresh
            worker streams), with one WARNING; the checkpoints saved from then on resume exactly.
        on_num_workers_change: ``"error"`` (default) or ``"warn"``: resuming with another
            ``dataloader_num_workers`` than the checkpoint's, for a dataset that may draw from the global
            streams, is refused, or continues inexactly with one WARNING.
        tensor_fingerprint: record the tensor locator's fingerprints (each micro-batch, its loss, the gradients
            before clipping, the update, what a resume loaded) into ``dump_folder/tensor_fingerprints/``.
        fingerprint_modules_at_step: with ``tensor_fingerprint``, at this optimizer step also hash every module
            call's inputs and outputs (up to the step's clipping); 0: none.
        fingerprint_optimizer_every_step: with ``tensor_fingerprint``, hash the optimizer state after every
            step's update, not only at saves and where training starts (with AdamW, twice the bytes a step hashes).
        dump_folder: where the fingerprints go, beside the run's loss log (``compare_losses`` reads both from
            it); default: ``output_dir``.
    """

    def __init__(self, *args: Any, on_stock_checkpoint: str = "error", on_num_workers_change: str = "error",
                 tensor_fingerprint: bool = False, fingerprint_modules_at_step: int = 0,
                 fingerprint_optimizer_every_step: bool = False, dump_folder: str | Path | None = None,
                 **kwargs: Any) -> None:
        for name, value in (("on_stock_checkpoint", on_stock_checkpoint),
                            ("on_num_workers_change", on_num_workers_change)):
            if value not in ("error", "warn"):
                raise ConfigError(f'ExactResumeTrainer {name}={value!r}: use "error" or "warn"')
        super().__init__(*args, **kwargs)
        if self.args.save_only_model:
            raise ValueError("ExactResumeTrainer needs save_only_model=False: a checkpoint without optimizer "
                             "and loader state cannot resume exactly")
        if self.args.train_sampling_strategy not in SAMPLING_STRATEGIES:
            raise ConfigError(f"ExactResumeTrainer train_sampling_strategy={self.args.train_sampling_strategy!r}: "
                             f"its loader samples {' or '.join(map(repr, SAMPLING_STRATEGIES))} only; use one of them")
        self.on_stock_checkpoint = on_stock_checkpoint
        self.on_num_workers_change = on_num_workers_change
        self._take_sigterm_from_jit_checkpoint()
        self._exact = _ExactResumeCallback()
        # First: every other callback (and the log) sees the epoch it corrects at each step's end.
        self.callback_handler.callbacks.insert(0, self._exact)
        self._exact_loader: EpochLoader | None = None
        if fingerprint_modules_at_step < 0:
            raise ConfigError(f"ExactResumeTrainer fingerprint_modules_at_step={fingerprint_modules_at_step}: it "
                              "must be >= 0")
        debug = Debug(tensor_fingerprint=True, fingerprint_modules_at_step=fingerprint_modules_at_step,
                      fingerprint_optimizer_every_step=fingerprint_optimizer_every_step)
        self._prints = _Fingerprints(self, debug, dump_folder) if tensor_fingerprint else None
        if self._prints is not None:
            self.callback_handler.callbacks.insert(1, self._prints)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        prints = self._prints.prints if self._prints is not None else None
        if prints is not None:
            prints.batch(inputs)
        loss = super().training_step(model, inputs, *args, **kwargs)
        if prints is not None:
            prints.loss(loss)  # this process's micro-batch loss, before any reduction over processes
        return loss

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        if self._prints is not None and self._prints.prints is not None:
            self._prints.prints.gradients()  # before clipping
        return super()._clip_grad_norm(model)

    def _take_sigterm_from_jit_checkpoint(self) -> None:
        """One owner of SIGTERM: this trainer (an agreed step, every process, between steps). The stock JIT
        callback stays in the list, as code that looks for it expects, with its SIGTERM handler (installed when
        the Trainer was built) taken back: only that handler ever asks it for a checkpoint."""
        for callback in self.callback_handler.callbacks:
            manager = getattr(callback, "jit_manager", None) if isinstance(callback, JITCheckpointCallback) else None
            if manager is not None:
                signal.signal(signal.SIGTERM, manager._original_sigterm_handler or signal.SIG_DFL)
                manager._original_sigterm_handler = None  # nothing for it to put back at the end of training
                log.warning("enable_jit_checkpoint: ExactResumeTrainer saves on SIGTERM itself, at a step every "
                            "process agrees on; the stock JIT checkpoint's SIGTERM handler is not installed")

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
            shuffle=SAMPLING_STRATEGIES[self.args.train_sampling_strategy],
            on_num_workers_change=self.on_num_workers_change,
        )
        return self._exact_loader

    @property
    def stopped_by(self) -> str | None:
        """The signal the last ``train()`` stopped for, after saving its checkpoint (``"SIGTERM"``...); None when
        it ran to its end: a script tells a preempted run from a finished one."""
        return self._exact.stopped_by

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        output_dir = self.args.output_dir
        fresh = not os.path.isdir(output_dir) or get_last_checkpoint(output_dir) is None
        if resume_from_checkpoint is True and fresh:
            if self.args.process_index == 0:
                log.warning("resume_from_checkpoint=True: %s holds no checkpoint yet; training from the start",
                            output_dir)
            resume_from_checkpoint = None
        try:
            with signals.handling():
                return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            if self._exact_loader is not None:
                self._exact_loader.close()

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """The stock evaluation, leaving every global stream as it found it (an evaluation loader without a
        generator of its own draws from torch's, and a model may draw in eval mode)."""
        with preserved_global_rng(self.args.device):
            return super().evaluate(*args, **kwargs)

    def _run_epoch(self, **kwargs: Any) -> Any:
        """The resumed epoch: load the loader and streams, then run only the batches the epoch has left
        (instead of the stock skip, which rebuilds the loader and fetches before restoring the streams)."""
        checkpoint = kwargs["resume_from_checkpoint"]
        if checkpoint is not None and kwargs["epoch"] == kwargs["epochs_trained"]:
            assert self._exact_loader is not None
            accumulation = self.args.gradient_accumulation_steps
            updates = kwargs["num_update_steps_per_epoch"]
            done = (self.state.global_step % updates) * accumulation
            self._resume_loader(checkpoint)
            self._exact.resumed_epoch = (kwargs["epoch"], updates, kwargs["steps_in_epoch"])
            kwargs.update(
                resume_from_checkpoint=None,
                steps_trained_in_current_epoch=0,
                steps_in_epoch=kwargs["steps_in_epoch"] - done,
                num_update_steps_per_epoch=updates - done // accumulation,
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

    def _resume_loader(self, checkpoint: str) -> None:
        assert self._exact_loader is not None
        path = os.path.join(checkpoint, STATE_FILE.format(rank=self.args.process_index))
        if os.path.isfile(path):
            self._exact_loader.load_state_dict(torch.load(path, weights_only=True))
            return
        stock = any(name.startswith("rng_state") for name in os.listdir(checkpoint))
        if not stock or self.on_stock_checkpoint == "error":
            raise ConfigError(
                f"{checkpoint} has no {os.path.basename(path)}: "
                + ("it was written by the stock Trainer; pass ExactResumeTrainer(..., on_stock_checkpoint=\"warn\") "
                   "to resume it once, inexactly" if stock else
                   f"it was not written by ExactResumeTrainer with {self.args.world_size} process(es); resume it "
                   "with that many processes")
            )
        if self.args.process_index == 0:
            log.warning("resuming %s, written by the stock Trainer, inexactly (on_stock_checkpoint=\"warn\"): its "
                        "global streams and the loader at its step, fresh worker streams; checkpoints saved from "
                        "now on resume exactly", checkpoint)
        self._exact_loader.skip(self.state.global_step * self.args.gradient_accumulation_steps)
        self._load_rng_state(checkpoint)
