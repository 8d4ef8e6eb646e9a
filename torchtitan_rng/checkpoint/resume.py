"""What a resume does when the checkpoint does not fit the run exactly.

* Another number of processes (the checkpoint's per-rank entries ``train_state.rank_{r}`` count the
  processes that saved it). ``checkpoint.on_world_size_change = "error"`` (default) refuses in one line.
  ``"reseed"`` continues inexactly: DCP reshards model and optimizer; no saved per-rank stream is used
  (rank r of M processes has no counterpart among N); every rank's global streams are reseeded from
  ``(seed, "reseed", step, rank)``; the data keeps its global position in the current epoch: each of the
  M ranks starts its share of the epoch's permutation at ceil(p * N / M), p being where the N ranks were
  (assuming the same ``training.local_batch_size``).
* Another device type (saved on CUDA, resumed on the CPU, or the reverse): the device generator's state
  has another format. Refused, unless ``checkpoint.allow_device_type_change``: then the device stream
  is reseeded as above and the CPU, NumPy and Python streams are restored.
* No RNG state (a checkpoint from an older version or another tool): a WARNING and reseeded streams;
  ``checkpoint.strict_rng`` makes it an error.

Every decision is taken from the checkpoint's metadata and the config, so all ranks take the same one.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from torchtitan_rng.checkpoint.manager import CheckpointError, LoadResult, verify_checkpoint
from torchtitan_rng.config import JobConfig
from torchtitan_rng.data.sampler import ResumableBatchSampler
from torchtitan_rng.rng import seed_training_streams, stream_seed
from torchtitan_rng.checkpoint.train_state import TrainState

_RANK_ENTRY = re.compile(r"^train_state\.rank_\d+$")


def saved_world_size(path: Path) -> int | None:
    """How many processes saved the checkpoint (None: it has no per-rank train state)."""
    count = sum(1 for key in verify_checkpoint(path).state_dict_metadata if _RANK_ENTRY.match(key))
    return count or None


def world_size_changed(path: Path, saved: int | None, current: int, policy: str) -> bool:
    """True when the run goes on with another process count ("reseed"); raises under "error"."""
    if saved is None or saved == current:
        return False
    if policy == "error":
        raise CheckpointError(
            f"checkpoint {path} was saved by {saved} processes and this run has {current}: it cannot resume "
            f"exactly; pass --checkpoint.on_world_size_change reseed to continue anyway (inexact), or run with "
            f"{saved} processes"
        )
    return True


@dataclass
class StreamPlan:
    """How the global streams start at the first resumed step."""

    mode: str  # "fresh" | "restore" | "host_only" | "reseed"
    step: int = 0


def plan_streams(config: JobConfig, train_state: TrainState, result: LoadResult | None, reseed: bool,
                 world_size: int, warn: Callable[[str], None]) -> StreamPlan:
    """Apply the policies above to what was loaded; warnings go through ``warn`` (rank 0 prints)."""
    ckpt = config.checkpoint
    if result is None or not ckpt.restore_rng or "train_state" in ckpt.exclude_from_loading:
        return StreamPlan("fresh")
    step = train_state.step
    if reseed:
        warn(f"WARNING: resuming {result.path} with {world_size} processes instead of the ones that saved it: "
             "model and optimizer are resharded, random streams and data order reseeded; this run is no longer "
             "exact")
        return StreamPlan("reseed", step)
    no_rng = "train_state" in result.missing or any(key.startswith("train_state.rank_") for key in result.missing)
    if no_rng:
        if ckpt.strict_rng:
            raise CheckpointError(
                f"checkpoint {result.path} holds no RNG state (saved by an older version or another tool) and "
                "checkpoint.strict_rng is set; drop --checkpoint.strict_rng to resume inexactly"
            )
        warn(f"WARNING: checkpoint {result.path} holds no RNG state (saved by an older version or another tool): "
             "random streams are reseeded and this run is not exact; --checkpoint.strict_rng makes this an error")
        return StreamPlan("reseed", step)
    saved_device = train_state.loaded["device_type"] if train_state.loaded else train_state.device.type
    if saved_device != train_state.device.type:
        if not ckpt.allow_device_type_change:
            raise CheckpointError(
                f"checkpoint {result.path} was saved on {saved_device} and this run is on "
                f"{train_state.device.type}: the device random stream cannot be restored here; pass "
                "--checkpoint.allow_device_type_change to restore the CPU, NumPy and Python streams (inexact)"
            )
        warn(f"WARNING: checkpoint {result.path} was saved on {saved_device}, this run is on "
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
