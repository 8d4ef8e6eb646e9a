"""The training loop, read top to bottom: build, resume, restore the random streams last, train, save.

A checkpoint signal (``signals.checkpoint_on``) only sets a flag; at each step boundary the ranks agree on
it, save at that step and exit 0 (see launch/preemption.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchtitan_rng import device as device_lib
from torchtitan_rng.checkpoint import resume as resume_policy
from torchtitan_rng.launch import preemption, run_lock
from torchtitan_rng.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    ModelState,
    OptimizerState,
    refuse_overwrite,
    resolve_checkpoint,
)
from torchtitan_rng.config import ConfigError, JobConfig, gradient_accumulation_steps
from torchtitan_rng.data.dataloader import ResumableDataLoader
from torchtitan_rng.data.streaming import StreamingDataLoader, WindowStream
from torchtitan_rng.data.worker_rng import with_worker_rng
from torchtitan_rng.distributed import World, all_ranks_agree_any, init_distributed, mean_over_ranks, teardown
from torchtitan_rng.fault_injection import fault_point
from torchtitan_rng.loss_log import LossLogWriter, loss_log_path
from torchtitan_rng.lr_scheduler import build_lr_scheduler
from torchtitan_rng.metrics import ProgressReporter
from torchtitan_rng.optimizer import build_optimizer
from torchtitan_rng import parallelize
from torchtitan_rng.train_step import forward_backward
from torchtitan_rng.rng import preserved_global_rng, seed_model_init
from torchtitan_rng.diagnosis.fingerprints import StreamProbe
from torchtitan_rng.train_spec import get_train_spec
from torchtitan_rng.checkpoint.train_state import TrainState


def _clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def _log(world: World, message: str) -> None:
    if world.rank == 0:
        print(message, flush=True)


def _take_run_lock(world: World, dump_folder: Path) -> None:
    """Rank 0 takes the dump folder's lock (or runs under the launcher's); every rank learns the outcome."""
    refused: run_lock.RunLockError | None = None
    if world.rank == 0:
        try:
            run_lock.acquire(dump_folder)  # released at exit
        except run_lock.RunLockError as err:
            refused = err
    if all_ranks_agree_any(refused is not None, world.device):
        raise refused or run_lock.RunLockError("rank 0 could not take the dump folder's lock (see its message)")


def _resume(config: JobConfig, world: World, checkpointer: CheckpointManager, train_state: TrainState,
            dataloader: ResumableDataLoader | StreamingDataLoader) -> resume_policy.StreamPlan:
    """Load the checkpoint to resume from, if any; the plan says how the random streams start."""
    ckpt = config.checkpoint
    if not ckpt.enable:
        if ckpt.initial_load_path or ckpt.load_step >= 0:
            raise ConfigError("checkpoint.initial_load_path / checkpoint.load_step need --checkpoint.enable")
        return resume_policy.StreamPlan("fresh")
    path = resolve_checkpoint(checkpointer.folder, ckpt.load_step, ckpt.initial_load_path)
    if path is None:
        return resume_policy.StreamPlan("fresh")
    saved_world = resume_policy.saved_world_size(path)
    reseed = resume_policy.world_size_changed(path, saved_world, world.world_size, ckpt.on_world_size_change)
    result = checkpointer.load(path, exclude=[*ckpt.exclude_from_loading, *(["dataloader"] if reseed else [])])
    last_step = config.training.steps
    refuse_overwrite(checkpointer.folder, [step for step in range(train_state.step + 1, last_step + 1)
                                           if checkpointer.should_save(step, last_step)])
    if reseed:
        resume_policy.reposition_sampler(dataloader.batch_sampler, train_state.step, saved_world)
    others = [name for name in result.missing if not name.startswith("train_state")]  # RNG: the policy's
    if others:
        _log(world, f"WARNING: checkpoint {path} holds no {', '.join(others)}; those start fresh")
    plan = resume_policy.plan_streams(config, train_state, result, reseed, world.world_size, lambda m: _log(world, m))
    _log(world, f"resumed from {path} at step {train_state.step}")
    return plan


def train(config: JobConfig) -> int:
    preemption.install(config.signals.checkpoint_on)
    world = init_distributed(config)
    if config.debug.deterministic:
        device_lib.use_deterministic_algorithms()
    spec = get_train_spec(config)
    accumulation = gradient_accumulation_steps(config, world.dp_world)
    dump_folder = Path(config.job.dump_folder)
    _take_run_lock(world, dump_folder)

    # Model: identical initial weights on every rank (shared stream), then sharded over the dp mesh.
    seed_model_init(config.debug.seed)
    model = spec.build_model(config).to(world.device)
    parallelize.apply_activation_checkpointing(model, spec, config)
    parallelize.apply_compile(model, spec, config)
    if world.world_size > 1:
        spec.apply_fsdp(model, world.mesh, parallelize.fsdp_mixed_precision(config))
    loss_fn = parallelize.compiled_loss(spec.loss_fn, model, config)
    compute_context = parallelize.autocast_context(config, world.device, world.world_size)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, config)
    lr_scheduler = build_lr_scheduler(optimizer, config)

    dataset = spec.build_dataset(config)
    loader_args = {"batch_size": config.training.local_batch_size, "dp_rank": world.dp_rank,
                   "dp_world": world.dp_world, "seed": config.debug.seed, "num_workers": config.data.num_workers,
                   "prefetch_factor": config.data.prefetch_factor,
                   # The loader counts micro-batches: the user's cadence is in optimizer steps.
                   "snapshot_every_n_steps": config.data.snapshot_every_n_steps * accumulation}
    dataloader: ResumableDataLoader | StreamingDataLoader
    if isinstance(dataset, WindowStream):  # data.streaming: file position and shuffle buffers are saved
        dataloader = StreamingDataLoader(dataset, **loader_args)
    elif config.data.streaming:
        raise ConfigError(f"config data.streaming: model {config.model.name!r} has no streaming source")
    else:
        # Form 2: a dataset that may use the global RNGs in workers gets them carried across a resume.
        dataloader = ResumableDataLoader(with_worker_rng(dataset, config.data.capture_worker_rng), **loader_args,
                                         on_num_workers_change=config.data.on_num_workers_change)
    probe = StreamProbe(config, rank=world.rank, world_size=world.world_size, device=world.device,
                        dataloader=dataloader)
    train_state = TrainState(world.device, world.rank, world.world_size)
    checkpointer = CheckpointManager(
        dump_folder / config.checkpoint.folder,
        {
            "model": ModelState(model),
            "optimizer": OptimizerState(model, optimizer),
            "lr_scheduler": lr_scheduler,
            "dataloader": dataloader,
            "train_state": train_state,
        },
        interval=config.checkpoint.interval,
        keep_latest_k=config.checkpoint.keep_latest_k,
        rank=world.rank,
        async_mode=config.checkpoint.async_mode,
    )
    stream_plan = _resume(config, world, checkpointer, train_state, dataloader)
    last_step = config.training.steps
    if train_state.step >= last_step:
        _log(world, f"nothing to do: the checkpoint is at step {train_state.step}, training.steps is {last_step}")
        teardown()
        return 0

    data_iter = iter(dataloader)
    # The global streams, last thing before the first step: after model build, the loader's iterator and
    # everything else that runs once at start-up, so that none of it shifts them.
    resume_policy.start_streams(stream_plan, train_state, config.debug.seed, world.rank)

    loss_log = LossLogWriter(loss_log_path(dump_folder)) if world.rank == 0 else None
    progress = ProgressReporter(
        log_freq=config.metrics.log_freq,
        last_step=last_step,
        items_per_step=spec.items_per_sample(config) * config.training.local_batch_size * world.dp_world * accumulation,
        unit=spec.throughput_unit,
        device=world.device,
        enabled=world.rank == 0,
    )
    stopped_at = None
    for step in range(train_state.step + 1, last_step + 1):
        fingerprints = probe.at_boundary(step, data_iter)  # {} unless debug.rng_fingerprint is on
        fault_point("before_step", step, world.rank)
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(model, data_iter, loss_fn, config, accumulation, world.device, compute_context)
        grad_norm = _clip_grad_norm(params, config.training.max_norm)
        lr = lr_scheduler.get_last_lr()[0]
        optimizer.step()
        lr_scheduler.step()
        train_state.step = step

        record: dict[str, Any] = {
            "step": step, "loss": float(mean_over_ranks(loss)), "lr": lr, "grad_norm": grad_norm,
        }
        if spec.validate is not None and config.validation.enable and step % config.validation.freq == 0:
            with preserved_global_rng(world.device):
                record.update(spec.validate(model, config, step, dump_folder, world.device))
        if loss_log is not None:
            loss_log.write({**record, **fingerprints})
        progress.step_done(step, record["loss"], lr)
        saved = config.checkpoint.enable and checkpointer.should_save(step, last_step)
        if saved:
            checkpointer.save(step, blocking=step == last_step)
        checkpointer.poll()
        # One all-reduce: a signal on any rank stops every rank at this same step boundary.
        if all_ranks_agree_any(preemption.received() is not None, world.device):
            if not saved:
                checkpointer.save(step)
            stopped_at = step
            break

    checkpointer.wait()  # a background save still being written (async_mode) is finished and renamed
    if loss_log is not None:
        loss_log.close()
    del data_iter  # shuts its workers down before the process group goes (docs/design.md, "Teardown order")
    teardown()
    if stopped_at is not None:
        _log(world, f"stopped by {preemption.received() or 'a signal to another rank'} at step {stopped_at}: "
                    f"checkpoint {checkpointer.folder / f'step-{stopped_at}'} saved; run the same command again "
                    "(with --checkpoint.enable) to resume")
    return 0


def run(config: JobConfig) -> int:
    """Train with a parsed config; bad input and unusable checkpoints are one line and exit code 2."""
    try:
        code = train(config)
    except (ConfigError, CheckpointError, run_lock.RunLockError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    if code == 0:
        preemption.mark_clean_exit()
    return code
