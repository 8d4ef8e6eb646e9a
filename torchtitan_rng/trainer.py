"""The training loop, read top to bottom: build, resume, restore the random streams last, train, save.

``Trainer(config)`` builds the run and resumes it; ``train()`` runs the steps; ``close()`` releases what
was opened, in every case (``try: trainer.train() finally: trainer.close()``): it finishes a background
save (or abandons it when the run failed), closes the loss log, shuts the dataloader's workers and tears
down the process group. The checkpointer owns the save policy; the loop only reports each step.

A checkpoint signal (``signals.checkpoint_on``, installed by the entry ``train.py``) only sets a flag; the
ranks agree on it with a vote that never waits (``distributed.StopVote``), save at the same step and exit 0
(see launch/preemption.py). Between sync points (every ``metrics.log_freq`` steps, each checkpoint and a
stop) a step reads nothing from the device: the loss log queues device tensors and writes them there.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.distributed.tensor import DTensor

from torchtitan_rng import device as device_lib
from torchtitan_rng.checkpoint import integrity, resume, run_record
from torchtitan_rng.checkpoint.layout import CheckpointError
from torchtitan_rng.checkpoint.manager import CheckpointManager
from torchtitan_rng.checkpoint.states import checkpoint_parts
from torchtitan_rng.checkpoint.train_state import TrainState
from torchtitan_rng.config import JobConfig, as_flags, gradient_accumulation_steps, snapshot_every_n_steps
from torchtitan_rng.errors import ConfigError, TorchtitanRngError, report
from torchtitan_rng.data.dataloader import ResumableDataLoader, map_style_problem, shutdown_workers
from torchtitan_rng.data.streaming import StreamingDataLoader, WindowStream
from torchtitan_rng.data.worker_rng import with_worker_rng
from torchtitan_rng.diagnosis.fingerprints import StreamProbe
from torchtitan_rng.distributed import (StopVote, World, init_distributed, mean_over_ranks, on_rank_zero,
                                        teardown)
from torchtitan_rng.fault_injection import FaultInjector
from torchtitan_rng.invariant import setup as invariant_setup, step as invariant_step
from torchtitan_rng.invariant.record import RECORD_PART, InvariantRecord
from torchtitan_rng.launch import preemption, preflight, run_lock
from torchtitan_rng.loss_log import LossLogWriter, loss_log_path
from torchtitan_rng.lr_scheduler import build_lr_scheduler
from torchtitan_rng.metrics import ProgressReporter
from torchtitan_rng.optimizer import build_optimizer, hyperparameters_from_config
from torchtitan_rng import parallelize
from torchtitan_rng.train_step import forward_backward, to_device
from torchtitan_rng.rng import preserved_global_rng, seed_model_init
from torchtitan_rng.train_spec import get_train_spec


def _clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """The total norm as a 0-d tensor on the device (the loss log reads it later, with no sync here)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm


def _on_rank_zero(world: World, check: Callable[[], object], elsewhere: Exception) -> None:
    """Run ``check`` on rank 0 only; when it refuses, every rank raises (rank 0 with its own message)."""
    on_rank_zero(check, elsewhere, world.device, (run_lock.RunLockError, CheckpointError, ConfigError))


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
        self.world = world = init_distributed(config)
        self._closing.callback(lambda: teardown(clean=not self._failed))
        self.stop_vote = StopVote()
        invariant = config.parallelism.world_size_invariant
        if invariant:
            invariant_setup.use_fixed_kernels()
        elif config.debug.deterministic:
            device_lib.use_deterministic_algorithms()
        self.spec = spec = get_train_spec(config)
        # The invariant mode splits global_batch_size into micro-batches itself.
        self.accumulation = accumulation = 1 if invariant else gradient_accumulation_steps(config, world.dp_world)
        self.dump_folder = Path(config.job.dump_folder)
        _take_run_lock(world, self.dump_folder)
        _on_rank_zero(world, lambda: preflight.refuse_restart_over_history(config),
                      ConfigError("the dump folder already holds a run (rank 0 says more)"))

        # Model: identical initial weights on every rank (shared stream), then sharded over the dp mesh.
        seed_model_init(config.debug.seed)
        self.model = model = spec.build_model(config).to(world.device)
        self.param_count = sum(p.numel() for p in model.parameters())
        parallelize.apply_activation_checkpointing(model, spec, config)
        parallelize.apply_compile(model, spec, config)
        sharded = world.world_size > 1 and not invariant  # the invariant mode replicates parameters
        if sharded:
            spec.apply_fsdp(model, world.mesh, parallelize.fsdp_mixed_precision(config))
        self.loss_fn = parallelize.compiled_loss(spec.loss_fn, model, config)
        self.compute_context = parallelize.autocast_context(config, world.device, sharded)
        model.train()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, config)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config)

        dataset = spec.build_dataset(config)
        if not isinstance(dataset, WindowStream) and (problem := map_style_problem(dataset)):
            raise ConfigError(f"model {config.model.name!r} (build_dataset of its TrainSpec): {problem}")
        self.layout = (invariant_setup.plan_layout(config, world.rank, world.world_size, dataset) if invariant
                       else None)
        loader_args = {"batch_size": config.training.local_batch_size, "dp_rank": world.dp_rank,
                       "dp_world": world.dp_world, "seed": config.debug.seed, "num_workers": config.data.num_workers,
                       "prefetch_factor": config.data.prefetch_factor,
                       # The loader counts micro-batches: the user's cadence is in optimizer steps.
                       "snapshot_every_n_steps": snapshot_every_n_steps(config) * accumulation}
        self.dataloader: ResumableDataLoader | StreamingDataLoader
        if isinstance(dataset, WindowStream):  # data.streaming: file position and shuffle buffers are saved
            self.dataloader = StreamingDataLoader(dataset, **loader_args)
        elif config.data.streaming:
            raise ConfigError(f"config data.streaming: model {config.model.name!r} has no streaming source")
        else:
            # Form 2: a dataset that may use the global RNGs in workers gets them carried across a resume.
            self.dataloader = ResumableDataLoader(
                with_worker_rng(dataset, config.data.capture_worker_rng), **loader_args,
                on_num_workers_change=config.data.on_num_workers_change,
                batch_sampler=(invariant_setup.global_sampler(len(dataset), config, self.layout) if self.layout
                               else None))
        # Its workers go before the process group does (docs/design.md, "Teardown order").
        self._closing.callback(lambda: shutdown_workers(self.dataloader))
        self.probe = StreamProbe(config, rank=world.rank, world_size=world.world_size, device=world.device,
                                 dataloader=self.dataloader, invariant=(
                                     (self.dataloader.batch_sampler, self.layout.first_slot) if self.layout else None))
        # The step lives here: the checkpointer saves it, the loop advances it.
        self.train_state = TrainState(world.device, world.rank, world.world_size)
        self.faults = FaultInjector.from_env(world.rank)
        self.checkpointer = CheckpointManager(
            self.dump_folder / config.checkpoint.folder,
            checkpoint_parts(model=model, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                             dataloader=self.dataloader, train_state=self.train_state,
                             extras={RECORD_PART: InvariantRecord(config)} if invariant else None),
            interval=config.checkpoint.interval,
            enable=config.checkpoint.enable,
            keep_latest_k=config.checkpoint.keep_latest_k,
            rank=world.rank,
            async_mode=config.checkpoint.async_mode,
            hooks=self.faults,
            log=self._log,
        )
        self.checkpointer.run_record = run_record.build_record(config, dataset)
        self._closing.callback(lambda: self.checkpointer.close(abandon=self._failed))
        self.stream_plan, self.resumed_from = resume.resume(
            config, world.world_size, self.checkpointer, self.train_state, self.dataloader.batch_sampler, self._log,
            vet=self._vet)
        # The config, not a loaded checkpoint, sets the hyperparameters (the schedule: lr_scheduler.py): the
        # same values unless checkpoint.allow_config_change let one change, and then the new one applies.
        hyperparameters_from_config(self.optimizer, config)

    def _vet(self, checkpoint: Path) -> None:
        """Before loading: its files as written (read once: by the launcher, or here by rank 0), and the
        config it was trained with against this one (every rank decides alike from the same files)."""
        verified = os.environ.get(integrity.VERIFIED_ENV) == str(checkpoint)
        if not (verified and (checkpoint / integrity.CHECKSUMS_NAME).is_file()):
            def verify() -> None:
                if not integrity.verify_integrity(checkpoint):
                    self._log(f"WARNING: checkpoint {checkpoint} has no checksums (saved by an older version): "
                              "damage to its files cannot be detected")
            _on_rank_zero(self.world, verify,
                          CheckpointError(f"checkpoint {checkpoint} is damaged (rank 0 names the file)"))
        for line in run_record.check_resume(checkpoint, run_record.read_record(checkpoint),
                                            self.checkpointer.run_record, self.config.checkpoint.allow_config_change):
            self._log(line)

    def _log(self, message: str) -> None:
        if self.world.rank == 0:
            print(message, flush=True)

    def _banner(self) -> None:
        config, ckpt = self.config, self.config.checkpoint
        trainable = sum(p.numel() for p in self.params)
        self._log(f"model {config.model.name} ({config.model.flavor}): {self.param_count:,} parameters, "
                  f"{trainable:,} trainable; {self.world.world_size} process(es) on {self.world.device.type}")
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

    def train(self) -> int:
        config, world, train_state = self.config, self.world, self.train_state
        last_step = config.training.steps
        self._banner()
        if train_state.step >= last_step:
            self._log(f"nothing to do: the checkpoint is at step {train_state.step}, training.steps is {last_step}")
            self._failed = False
            return 0

        data_iter = iter(self.dataloader)
        # The global streams, last thing before the first step: after model build, the loader's iterator and
        # everything else that runs once at start-up, so that none of it shifts them.
        resume.start_streams(self.stream_plan, train_state, config.debug.seed, world.rank)

        loss_log = LossLogWriter(loss_log_path(self.dump_folder)) if world.rank == 0 else None
        if loss_log is not None:
            self._closing.callback(loss_log.close)
        progress = ProgressReporter(
            log_freq=config.metrics.log_freq,
            last_step=last_step,
            items_per_step=self.spec.items_per_sample(config) * (config.training.global_batch_size if self.layout else
                                                                  config.training.local_batch_size * world.dp_world
                                                                  * self.accumulation),
            unit=self.spec.throughput_unit,
            device=world.device,
            enabled=world.rank == 0,
        )  # its clock starts here: build, resume and the workers' start-up are not in the throughput
        stopped_at = None
        for step in range(train_state.step + 1, last_step + 1):
            fingerprints = self.probe.at_boundary(step, data_iter)  # {} unless debug.rng_fingerprint is on
            if self.faults is not None:
                self.faults.at("before_step", step)
            record = self._step(step, data_iter)
            train_state.step = step
            # Every step, with no blocking read: a signal on any rank stops every rank at the same boundary.
            stop = self.stop_vote.poll(preemption.received() is not None)
            # The host reads device values only at sync points: every log_freq steps, before each checkpoint
            # (so a kill loses only steps the resume redoes) and at the last step.
            sync_point = (stop or step % config.metrics.log_freq == 0 or step == last_step
                          or self.checkpointer.should_save(step, last_step))
            written = None
            if loss_log is not None:
                loss_log.write({**record, **fingerprints})
                written = loss_log.flush() if sync_point else None
            progress.step_done(step, written or record)  # it prints only at sync points, from what was written
            self.checkpointer.save(step, last_step=last_step, force=stop)
            if stop:
                stopped_at = step
                break
        self.stop_vote.close()

        self.checkpointer.wait()  # a background save still being written (async_mode) is finished and renamed
        self._failed = False
        if stopped_at is not None:
            self._log(f"stopped by {preemption.received() or 'a signal to another rank'} at step {stopped_at}: "
                      f"checkpoint {self.checkpointer.folder / f'step-{stopped_at}'} saved; "
                      f"{preflight.how_to_resume(config)}")
        return 0

    def _step(self, step: int, batches: Iterator[dict[str, Any]]) -> dict[str, Any]:
        """One optimizer step; returns its loss-log record."""
        config = self.config
        self.optimizer.zero_grad(set_to_none=True)
        if self.layout is not None:  # its loss is the same tree sum on every rank
            loss = invariant_step.forward_backward(self.model, self.params,
                                                   lambda: to_device(next(batches), self.world.device),
                                                   self.loss_fn, config, self.layout, step, self.compute_context)
        else:
            loss = mean_over_ranks(forward_backward(self.model, batches, self.loss_fn, config, self.accumulation,
                                                    self.world.device, self.compute_context))
        grad_norm = _clip_grad_norm(self.params, config.training.max_norm)
        lr = self.lr_scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.lr_scheduler.step()
        record: dict[str, Any] = {
            "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
        }
        if self.spec.validate is not None and config.validation.enable and step % config.validation.freq == 0:
            with preserved_global_rng(self.world.device):
                record.update(self.spec.validate(self.model, config, step, self.dump_folder, self.world.device))
        return record

    def close(self) -> None:
        """Release everything the run opened; safe to call after a failure at any point, and twice."""
        self._closing.close()


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
    preemption.mark_clean_exit()
    return 0
