"""The training loop, read top to bottom: build, resume, restore the random streams last, train, save.

``Trainer(config)`` builds the run and resumes it; ``train()`` runs the steps; ``close()`` releases what
was opened, in every case (``try: trainer.train() finally: trainer.close()``): it finishes a background
save (or abandons it when the run failed), closes the loss log, shuts the dataloader's workers and tears
down the process group. The checkpointer owns the save policy; the loop only reports each step.

A checkpoint signal (``signals.checkpoint_on``, installed by the entry ``train.py``) only sets a flag; the
ranks agree on it with a vote that never waits (``distributed.StopVote``), save at the same step and exit 0
(see signals.py). Between sync points (every ``metrics.log_freq`` steps, each checkpoint and a
stop) a step reads nothing from the device: the loss log queues device tensors and writes them there.
"""

from __future__ import annotations

import gc
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from torchtitan_rng import resume, signals
from torchtitan_rng.build import build_components
from torchtitan_rng.checkpoint.manager import CheckpointManager
from torchtitan_rng.config import JobConfig, as_flags
from torchtitan_rng.data.dataloader import shutdown_workers
from torchtitan_rng.diagnosis.fingerprints import StreamProbe
from torchtitan_rng.diagnosis.tensor_fingerprints import build_tensor_fingerprints
from torchtitan_rng.distributed import StopVote, World, all_ranks_agree_any, init_distributed, on_rank_zero, teardown
from torchtitan_rng.errors import CheckpointError, ConfigError, TorchtitanRngError, report
from torchtitan_rng.fault_injection import FaultInjector
from torchtitan_rng.fault_points import hold_at
from torchtitan_rng.launch import preflight, run_lock
from torchtitan_rng.loss_log import LossLogWriter, loss_log_path
from torchtitan_rng.metrics import ProgressReporter
from torchtitan_rng.optimizer import hyperparameters_from_config
from torchtitan_rng.rng import preserved_global_rng
from torchtitan_rng.sample_log import SampleLog
from torchtitan_rng.skips import apply_update, skipped_steps
from torchtitan_rng.spike_guard import decisions


def _on_rank_zero(world: World, check: Callable[[], object], elsewhere: Exception) -> None:
    """Run ``check`` on rank 0 only; when it refuses, every rank raises (rank 0 with its own message)."""
    on_rank_zero(check, elsewhere, world.device, (TorchtitanRngError,))


def _take_run_lock(world: World, dump_folder: Path) -> None:
    """Rank 0 takes the dump folder's lock (or runs under the launcher's); every rank learns the outcome."""
    preflight.check_dump_folder(dump_folder)
    run_lock.join(dump_folder)  # under the launcher's lock: this rank's pid keeps it held while it lives
    _on_rank_zero(world, lambda: run_lock.acquire(dump_folder),  # released at exit
                  run_lock.RunLockError("rank 0 could not take the dump folder's lock (see its message)"))


class Trainer:
    """One run: built and resumed by the constructor, trained by :meth:`train`, released by :meth:`close`."""

    def __init__(self, config: JobConfig) -> None:
        self.config = config
        self._failed = True  # until train() returns: close() then abandons instead of finishing
        self._closing = ExitStack()  # what close() releases, last opened first
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        config = self.config
        self.stopped_before_training = False  # a signal during start-up: nothing was trained or saved
        self.finished = False  # the last step is saved (now or by an earlier run)
        hold_at("before_process_group", int(os.environ.get("RANK", "0")))
        self.world = world = init_distributed(config.parallelism)
        self._closing.callback(lambda: teardown(clean=not self._failed))
        self._closing.callback(self._release)  # just before the teardown
        self.faults = FaultInjector.from_env(world.rank)
        if self.faults is not None:
            self.faults.at("startup", 0)
        self.stop_vote = StopVote()
        self.dump_folder = Path(config.job.dump_folder)
        _take_run_lock(world, self.dump_folder)
        _on_rank_zero(world, lambda: preflight.refuse_restart_over_history(config),
                      ConfigError("the dump folder already holds a run (rank 0 says more)"))

        def claim() -> None:  # under the launcher, which claimed it, this finds the folder this run's
            for line in resume.claim_folder(config):
                self._log(line)

        _on_rank_zero(world, claim, CheckpointError("the checkpoint folder belongs to another run (rank 0 says more)"))

        self.parts = parts = build_components(config, world)
        self.plan, self.train_state = parts.plan, parts.train_state  # the step lives in the train state
        if self.faults is not None:  # compiled code is built at its first call: in the step running then
            self.faults.watch_compiles(lambda: self.train_state.step + 1)
        # Its workers go before the process group does (docs/design.md, "Teardown order").
        self._closing.callback(lambda: shutdown_workers(parts.dataloader))
        self.probe = StreamProbe(config.debug, self.plan, rank=world.rank, world_size=world.world_size,
                                 dataloader=parts.dataloader)
        self.skipped_steps = skipped_steps(config.training)
        self.checkpointer = CheckpointManager(
            resume.folder_of(config),
            parts.checkpoint_parts(),
            interval=config.checkpoint.interval,
            enable=config.checkpoint.enable,
            keep_latest_k=config.checkpoint.keep_latest_k,
            rank=world.rank,
            async_mode=config.checkpoint.async_mode,
            hooks=self.faults,
            log=self._log,
            signing=resume.signing_of(config.checkpoint),
            owner=resume.owner_of(config),
        )
        self.checkpointer.run_record = resume.build_record(config, parts.dataset)
        self._closing.callback(lambda: self.checkpointer.close(abandon=self._failed))
        self.stream_plan, self.resumed_from = resume.resume(config, self.plan, self.checkpointer, self.train_state,
                                                            parts.dataloader.batch_sampler, self._log)
        # The config, not a loaded checkpoint, sets the hyperparameters (the schedule: lr_scheduler.py): the
        # same values unless checkpoint.allow_config_change let one change, and then the new one applies.
        hyperparameters_from_config(parts.optimizer, config.optimizer)
        # After the resume: a run refused there leaves no fingerprint file behind.
        self.tensor_prints = build_tensor_fingerprints(config.debug, parts.model, parts.optimizer, rank=world.rank,
                                                       world_size=world.world_size, dump_folder=self.dump_folder,
                                                       config=self.checkpointer.run_record["config"])
        if self.tensor_prints is not None:
            self._closing.callback(self.tensor_prints.close)

    def _log(self, message: str) -> None:
        if self.world.rank == 0:
            print(message, flush=True)

    def _banner(self) -> None:
        config, ckpt = self.config, self.config.checkpoint
        trainable = sum(p.numel() for p in self.parts.params)
        if config.job.description:
            self._log(config.job.description)
        self._log(f"model {config.model.name} ({config.model.flavor}): {self.parts.param_count:,} parameters, "
                  f"{trainable:,} trainable; {self.world.world_size} process(es) on {self.world.device.type}")
        layout = self.plan.describe()
        if layout:
            self._log(layout)
        self._log(f"dump folder {self.dump_folder}")
        if ckpt.enable:
            mode = ", async" if ckpt.async_mode == "async" else ""
            self._log(f"checkpointing into {self.checkpointer.folder} every {ckpt.interval} steps{mode}")
        else:
            self._log("checkpointing off (a stop signal still saves)")
        if self.resumed_from is None:
            self._log("fresh start")
        else:
            self._log(f"resumed from {self.resumed_from} at step {self.train_state.step}")

    def train(self) -> None:
        config, world, train_state = self.config, self.world, self.train_state
        last_step = config.training.steps
        self._banner()
        if train_state.step >= last_step:
            self._log(f"nothing to do: the checkpoint is at step {train_state.step}, training.steps is {last_step}")
            self._failed = False
            self.finished = True
            return

        data_iter = iter(self.parts.dataloader)
        if self.faults is not None:
            self.faults.at("startup_done", 0)
        # A signal during start-up (build, resume, the workers' start): nothing new to save, a clean exit.
        if all_ranks_agree_any(signals.received() is not None, world.device):
            self._failed = False
            self.stopped_before_training = True
            self._log(f"stopped by {signals.received() or 'a signal to another rank'} during start-up, before step "
                      f"{train_state.step + 1}: nothing new to save; {preflight.how_to_resume(config.checkpoint)}")
            return
        samples = (SampleLog(world.rank, world.world_size, self.plan.data_shard[0], self.plan.slot)
                   if config.metrics.log_samples else None)
        batches = samples.batches(data_iter) if samples is not None else data_iter
        if self.tensor_prints is not None:  # hashes each batch as the plan takes it
            batches = self.tensor_prints.batches(batches)
        # The global streams, last thing before the first step: after model build, the loader's iterator and
        # everything else that runs once at start-up, so that none of it shifts them.
        resume.start_streams(self.stream_plan, train_state, config.debug.seed, self.plan.stream_rank)

        loss_log = LossLogWriter(loss_log_path(self.dump_folder)) if world.rank == 0 else None
        if loss_log is not None:
            self._closing.callback(loss_log.close)
        progress = ProgressReporter(
            log_freq=config.metrics.log_freq,
            last_step=last_step,
            items_per_step=self.parts.spec.items_per_sample(config) * self.plan.samples_per_step,
            unit=self.parts.spec.throughput_unit,
            device=world.device,
            enabled=world.rank == 0,
        )  # its clock starts here: build, resume and the workers' start-up are not in the throughput
        stopped_at = None
        for step in range(train_state.step + 1, last_step + 1):
            fingerprints = self.probe.at_boundary(step, data_iter)  # {} unless debug.rng_fingerprint is on
            if self.faults is not None:
                self.faults.at("before_step", step)
            record = self._step(step, batches)
            train_state.step = step
            # Every step, with no blocking read: a signal on any rank stops every rank at the same boundary.
            stop = self.stop_vote.poll(signals.received() is not None)
            # The host reads device values only at sync points: every log_freq steps, before each checkpoint
            # (so a kill loses only steps the resume redoes) and at the last step.
            sync_point = (stop or step % config.metrics.log_freq == 0 or step == last_step
                          or self.checkpointer.should_save(step, last_step))
            line = {**record, **fingerprints}
            if samples is not None:  # every rank: the keys are gathered at sync points
                samples.step_done(step, line)
                if sync_point:
                    samples.sync()
            if self.tensor_prints is not None:
                self.tensor_prints.updated(flush=False)
                if self.checkpointer.should_save(step, last_step) or (stop and self.checkpointer.enable):
                    self.tensor_prints.saving(step)  # the optimizer state, where a checkpoint holds it
                elif sync_point:
                    self.tensor_prints.flush()
            written: list[dict[str, Any]] = []
            if loss_log is not None:
                loss_log.write(line)
                written = loss_log.flush() if sync_point else []
                for message in decisions(written, self.skipped_steps):
                    self._log(message)
            progress.step_done(step, written[-1] if written else record)  # it prints only at sync points
            self.checkpointer.save(step, last_step=last_step, force=stop)
            if stop:
                stopped_at = step
                break
        self.stop_vote.close()

        self.checkpointer.wait()  # a background save still being written (async_mode) is finished and renamed
        self._failed = False
        self.finished = train_state.step == last_step
        if stopped_at is not None:
            then = ("it was the last: training is finished" if self.finished
                    else preflight.how_to_resume(config.checkpoint))
            self._log(f"stopped by {signals.received() or 'a signal to another rank'} at step {stopped_at}: "
                      f"checkpoint {self.checkpointer.folder / f'step-{stopped_at}'} saved; {then}")

    def _step(self, step: int, batches: Iterator[dict[str, Any]]) -> dict[str, Any]:
        """One optimizer step; returns its loss-log record. A skipped step (training.skip_steps, skips.py) loads,
        draws and computes as a trained one, and only its update is left out."""
        config, parts = self.config, self.parts
        parts.optimizer.zero_grad(set_to_none=True)
        loss_fn = self.faults.loss_fn(parts.loss_fn, step) if self.faults is not None else parts.loss_fn
        if self.tensor_prints is not None:
            self.tensor_prints.step_begin(step)
            loss_fn = self.tensor_prints.losses(loss_fn)
        loss = self.plan.forward_backward(parts.model, parts.params, batches, loss_fn, step)
        if self.tensor_prints is not None:
            self.tensor_prints.gradients()
        grad_norm = self.plan.clip_grad_norm(parts.params, config.training.max_norm)
        lr = parts.lr_scheduler.get_last_lr()[0]
        record: dict[str, Any] = {
            "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
        }
        given = step in self.skipped_steps
        if parts.spike_guard is None and not given:
            parts.optimizer.step()
        else:  # decided on the device; the loss log reads it at its next sync point (a bool: see loss_log.py)
            skip = (parts.spike_guard.judge({"loss": loss, "grad_norm": grad_norm}, given)
                    if parts.spike_guard is not None else torch.tensor(True, device=self.world.device))
            apply_update(parts.optimizer, skip)
            record["skipped"] = skip
        parts.lr_scheduler.step()  # on the same curve either way
        if parts.spec.validate is not None and config.validation.enable and step % config.validation.freq == 0:
            if self.faults is not None:
                self.faults.at("validation", step)
            with preserved_global_rng(self.world.device):
                record.update(parts.spec.validate(parts.model, config, step, self.dump_folder, self.world.device))
        return record

    def close(self) -> None:
        """Release everything the run opened; safe to call after a failure at any point, and twice."""
        self._closing.close()

    # What holds a process group: FSDP's state in the model (and so the optimizer, the checkpoint parts), the
    # stop vote's group; the mesh resolves its groups by name. replay_step's observer wraps _step around the model.
    _HOLDING_GROUPS = ("parts", "plan", "train_state", "probe", "checkpointer", "stop_vote", "stream_plan", "faults",
                       "tensor_prints", "_step")

    def _release(self) -> None:
        """Drop the references to the process groups before the teardown, so that destroy_process_group()
        destroys them and joins their gloo worker threads while Python is alive. A group that outlives it keeps
        threads that may drop a collective's Python tensor after finalization began: the GIL they then ask for
        ends them inside a C++ destructor, i.e. std::terminate ("terminate called without an active exception",
        SIGABRT) after a run that finished. Then world and dump_folder stay, the rest is gone."""
        for name in self._HOLDING_GROUPS:
            self.__dict__.pop(name, None)
        if getattr(self, "world", None) is not None:
            self.world.mesh = None
        gc.collect()  # the model's modules and FSDP's hooks refer to each other


def run(config: JobConfig) -> int:
    """Train with a parsed config; bad input and unusable checkpoints are one line and exit code 2."""
    try:
        trainer = Trainer(config)
        try:
            trainer.train()
        finally:
            trainer.close()
    except TorchtitanRngError as err:
        return report(err, as_flags)
    signals.mark_clean_exit(signals.STARTUP if trainer.stopped_before_training
                            else signals.FINISHED if trainer.finished else "")
    return 0
