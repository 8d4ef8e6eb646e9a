"""The one resume path: pick the checkpoint, inspect it once, load it, and decide how the random streams
start. The trainer and ``ExactResume.load`` both go through :func:`load_checkpoint`.

When the checkpoint does not fit the run exactly:

* Another number of processes (the checkpoint's per-rank entries ``train_state.rank_{r}`` count the
  processes that saved it): refused in one line. The trainer's ``checkpoint.on_world_size_change =
  "reseed"`` continues inexactly instead: DCP reshards model and optimizer; no saved per-rank stream is
  used (rank r of M processes has no counterpart among N); every rank's global streams are reseeded from
  ``(seed, "reseed", step, rank)``; the data keeps its global position in the current epoch: each of the
  M ranks starts its share of the epoch's permutation at ceil(p * N / M), p being where the N ranks were
  (assuming the same ``training.local_batch_size``).
* Another device type (saved on CUDA, resumed on the CPU, or the reverse): the device generator's state
  has another format. Refused, unless ``checkpoint.allow_device_type_change``: then the device stream
  is reseeded as above and the CPU, NumPy and Python streams are restored.
* No RNG state (a checkpoint from an older version or another tool): a WARNING and reseeded streams;
  ``checkpoint.strict_rng`` makes it an error.

* A world-size-invariant run (``parallelism.world_size_invariant``): any power-of-two process count
  continues its checkpoints exactly; the dataloader is not loaded (its position is the step's) and the
  streams are not restored (each micro-batch seeds its own). A checkpoint of the other mode is refused.

Every decision is taken from the checkpoint's metadata and the config, so all ranks take the same one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from torchtitan_rng.checkpoint import layout
from torchtitan_rng.checkpoint.layout import CheckpointError
from torchtitan_rng.checkpoint.manager import CheckpointManager, LoadResult
from torchtitan_rng.checkpoint.safe_load import CheckpointInfo, inspect_checkpoint
from torchtitan_rng.checkpoint.train_state import TrainState
from torchtitan_rng.config import ConfigError, JobConfig
from torchtitan_rng.data.global_sampler import GlobalBatchSampler
from torchtitan_rng.data.sampler import ResumableBatchSampler
from torchtitan_rng.invariant.record import check_checkpoint_mode
from torchtitan_rng.rng import seed_training_streams, stream_seed


def world_size_changed(info: CheckpointInfo, current: int, on_change: str | None, invariant: bool = False) -> bool:
    """True when the run goes on with another process count (``on_change == "reseed"``); raises otherwise.
    ``on_change`` None: no inexact alternative is offered. A world-size-invariant run continues its own
    checkpoints at any process count (False); the checkpoint's mode must be the run's."""
    check_checkpoint_mode(info, invariant)
    saved = info.saved_world_size
    if invariant or saved is None or saved == current:
        return False
    if on_change == "reseed":
        return True
    alternative = ' or pass on_world_size_change="reseed" to continue anyway (inexact),' if on_change else ""
    raise CheckpointError(
        f"checkpoint {info.path} was saved by {saved} processes and this run has {current}: it cannot resume "
        f"exactly;{alternative} run with {saved} processes"
    )


@dataclass
class Loaded:
    """A loaded checkpoint: what it holds, what this rank found missing, and whether the process count
    changed (then the dataloader was not loaded and the streams must be reseeded)."""

    info: CheckpointInfo
    result: LoadResult
    reseed: bool


def load_checkpoint(manager: CheckpointManager, path: Path, *, world_size: int,
                    on_world_size_change: str | None = None, exclude: Sequence[str] = (),
                    invariant: bool = False, vet: Callable[[Path], None] | None = None) -> Loaded:
    """Inspect ``path`` once (whole, safe, saved by how many processes) and load it into ``manager``'s parts.
    ``invariant``: the data position follows from the step, so the dataloader is not loaded. ``vet`` may
    refuse the checkpoint after the inspection, before anything is loaded."""
    info = inspect_checkpoint(path)
    reseed = world_size_changed(info, world_size, on_world_size_change, invariant)  # its own message, first
    if vet is not None:
        vet(path)
    result = manager.load(info, exclude=[*exclude, *([layout.DATALOADER] if reseed or invariant else [])])
    return Loaded(info, result, reseed)


@dataclass
class StreamPlan:
    """How the global streams start at the first resumed step."""

    mode: str  # "fresh" | "restore" | "host_only" | "reseed"
    step: int = 0


def resume(config: JobConfig, world_size: int, checkpointer: CheckpointManager, train_state: TrainState,
           sampler: ResumableBatchSampler | GlobalBatchSampler, log: Callable[[str], None],
           vet: Callable[[Path], None] | None = None) -> tuple[StreamPlan, Path | None]:
    """The trainer's resume: load the checkpoint to start from, if any; returns how the random streams
    start and the checkpoint loaded (None: a fresh start). ``log`` prints on rank 0; ``vet`` (files and
    run record) may refuse the checkpoint before it is loaded."""
    ckpt = config.checkpoint
    if not ckpt.enable:
        if ckpt.initial_load_path or ckpt.load_step >= 0:
            raise ConfigError("checkpoint.initial_load_path / checkpoint.load_step need --checkpoint.enable")
        return StreamPlan("fresh"), None
    path = layout.resolve_checkpoint(checkpointer.folder, ckpt.load_step, ckpt.initial_load_path)
    if path is None:
        return StreamPlan("fresh"), None
    invariant = config.parallelism.world_size_invariant
    loaded = load_checkpoint(checkpointer, path, world_size=world_size, on_world_size_change=ckpt.on_world_size_change,
                             exclude=ckpt.exclude_from_loading, invariant=invariant, vet=vet)
    last_step = config.training.steps
    layout.refuse_overwrite(checkpointer.folder, [step for step in range(train_state.step + 1, last_step + 1)
                                                  if checkpointer.should_save(step, last_step)])
    if invariant:  # the data position and the random streams follow from the step alone
        sampler.load_state_dict({"step": train_state.step, "slot": 0})
        return StreamPlan("fresh"), path
    if loaded.reseed:
        reposition_sampler(sampler, train_state.step, loaded.info.saved_world_size or world_size)
    # A missing train state (RNG) is the stream policy's to judge, below.
    others = [name for name in loaded.result.missing if not name.startswith(layout.TRAIN_STATE)]
    if others:
        log(f"WARNING: checkpoint {path} holds no {', '.join(others)}; those start fresh")
    return plan_streams(config, train_state, loaded, world_size, log), path


def plan_streams(config: JobConfig, train_state: TrainState, loaded: Loaded, world_size: int,
                 warn: Callable[[str], None]) -> StreamPlan:
    """Apply the policies above to what was loaded; warnings go through ``warn`` (rank 0 prints)."""
    ckpt = config.checkpoint
    if not ckpt.restore_rng or layout.TRAIN_STATE in ckpt.exclude_from_loading:
        return StreamPlan("fresh")
    path, step = loaded.info.path, train_state.step
    if loaded.reseed:
        warn(f"WARNING: resuming {path} with {world_size} processes instead of the ones that saved it: "
             "model and optimizer are resharded, random streams and data order reseeded; this run is no longer "
             "exact")
        return StreamPlan("reseed", step)
    no_rng = any(key == layout.TRAIN_STATE or key.startswith(layout.TRAIN_STATE + ".") for key in loaded.result.missing)
    if no_rng:
        if ckpt.strict_rng:
            raise CheckpointError(
                f"checkpoint {path} holds no RNG state (saved by an older version or another tool) and "
                "checkpoint.strict_rng is set; drop --checkpoint.strict_rng to resume inexactly"
            )
        warn(f"WARNING: checkpoint {path} holds no RNG state (saved by an older version or another tool): "
             "random streams are reseeded and this run is not exact; --checkpoint.strict_rng makes this an error")
        return StreamPlan("reseed", step)
    saved_device = train_state.loaded["device_type"] if train_state.loaded else train_state.device.type
    if saved_device != train_state.device.type:
        if not ckpt.allow_device_type_change:
            raise CheckpointError(
                f"checkpoint {path} was saved on {saved_device} and this run is on "
                f"{train_state.device.type}: the device random stream cannot be restored here; pass "
                "--checkpoint.allow_device_type_change to restore the CPU, NumPy and Python streams (inexact)"
            )
        warn(f"WARNING: checkpoint {path} was saved on {saved_device}, this run is on "
             f"{train_state.device.type}: CPU, NumPy and Python streams restored, the device stream reseeded; "
             "this run is not exact")
        return StreamPlan("host_only", step)
    return StreamPlan("restore", step)


def start_streams(plan: StreamPlan, train_state: TrainState, seed: int, rank: int) -> None:
    """Set the global streams; call it last before the first step (after every start-up draw)."""
    if plan.mode == "restore":
        train_state.restore_rng()
        return
    if plan.mode == "fresh":
        seed_training_streams(seed, rank)
        return
    seed_training_streams(stream_seed("reseed", seed, plan.step), rank)
    if plan.mode == "host_only":
        train_state.restore_rng(include_device=False)


def reposition_sampler(sampler: object, step: int, saved_world: int) -> None:
    """Keep the data's global position in the epoch when the process count changed (see above)."""
    if not isinstance(sampler, ResumableBatchSampler):  # a streaming source's split is part of its state
        raise CheckpointError(f"a streaming source (data.streaming) cannot be re-split over another process "
                              f"count: resume with {saved_world} processes")
    per_rank_before = sampler.num_samples // saved_world
    epoch, position = divmod(step * sampler.batch_size, per_rank_before)
    per_rank_now = sampler.num_samples // sampler.dp_world
    position_now = min(per_rank_now, math.ceil(position * saved_world / sampler.dp_world))
    sampler.load_state_dict({"epoch": epoch, "position": position_now})
