"""What world-size-invariant training requires of a run, and what it records in a checkpoint.

Checked before training, each refusal one line: a power-of-two process count that divides the micro-batches
per step (``training.global_batch_size / training.local_batch_size``), a dataset whose randomness comes from
sample keys (form 1), and no sharding (parameters are replicated). Every process runs one intra-op thread
and torch's deterministic kernels, whatever the process count: a multi-threaded CPU kernel may split a
reduction by its thread count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

from torchtitan_rng import device as device_lib
from torchtitan_rng.checkpoint import resume as resume_policy
from torchtitan_rng.checkpoint.manager import CheckpointError, verify_checkpoint
from torchtitan_rng.config import ConfigError, JobConfig
from torchtitan_rng.data.global_sampler import GlobalBatchSampler
from torchtitan_rng.data.worker_rng import uses_global_rng
from torchtitan_rng.invariant.step import Layout

# The checkpoint part that marks an invariant run and holds the batch shape its data positions assume.
RECORD_PART = "world_size_invariant"
_FLAG = "--parallelism.world_size_invariant"


def check_batch_layout(config: JobConfig, world: int) -> int:
    """The micro-batches per step; raises ConfigError when ``world`` processes cannot split them invariantly
    (checked by the launcher too, before any process starts)."""
    training = config.training
    if training.global_batch_size < 1:
        raise ConfigError(f"{_FLAG} needs training.global_batch_size (samples per optimizer step, the same at "
                          "every process count); set it to a multiple of training.local_batch_size")
    if training.global_batch_size % training.local_batch_size:
        raise ConfigError(f"{_FLAG}: training.global_batch_size = {training.global_batch_size} is not a multiple "
                          f"of training.local_batch_size = {training.local_batch_size} (the micro-batch); "
                          "choose a multiple")
    micro_batches = training.global_batch_size // training.local_batch_size
    if world & (world - 1) or micro_batches % world:
        raise ConfigError(f"{_FLAG} needs a power-of-two number of processes that divides the {micro_batches} "
                          f"micro-batches per step (global / local batch size); got {world} processes")
    if config.parallelism.data_parallel_shard_degree != -1:
        raise ConfigError(f"{_FLAG} replicates the model instead of sharding it; leave "
                          "parallelism.data_parallel_shard_degree at -1")
    if config.data.streaming:
        raise ConfigError(f"{_FLAG} places samples by index in a map-style dataset, and a streaming source has no "
                          "index; drop --data.streaming")
    return micro_batches


def plan_layout(config: JobConfig, rank: int, world: int, dataset: Dataset) -> Layout:
    """This rank's share of each step; raises ConfigError when the run cannot be world-size-invariant."""
    micro_batches = check_batch_layout(config, world)
    if isinstance(dataset, IterableDataset):
        raise ConfigError(f"{_FLAG} places samples by index in a map-style dataset; {type(dataset).__name__} is "
                          "an IterableDataset")
    if uses_global_rng(dataset):
        raise ConfigError(f"{_FLAG} needs a dataset that derives its randomness from sample keys (form 1, "
                          f"SampleRandomDataset); {type(dataset).__name__} may draw from the global RNGs")
    return Layout(micro_batches=micro_batches, rank=rank, world=world)


def use_fixed_kernels() -> None:
    """The same kernels at every process count: one intra-op thread, deterministic algorithms."""
    torch.set_num_threads(1)
    device_lib.use_deterministic_algorithms()


def global_sampler(num_samples: int, config: JobConfig, layout: Layout) -> GlobalBatchSampler:
    return GlobalBatchSampler(num_samples, config.training.local_batch_size, layout.micro_batches, layout.rank,
                              layout.world, config.debug.seed)


def position_sampler(sampler: GlobalBatchSampler, step: int) -> None:
    """After ``step`` steps: the data position is a function of the step alone (no saved per-rank state)."""
    sampler.load_state_dict({"step": step, "slot": 0})


def is_invariant_checkpoint(path: Path) -> bool:
    return any(key.startswith(RECORD_PART + ".") for key in verify_checkpoint(path).state_dict_metadata)


def check_checkpoint_mode(path: Path, invariant: bool) -> None:
    """An invariant run resumes only invariant checkpoints, and an ordinary run only ordinary ones."""
    saved = is_invariant_checkpoint(path)
    if saved and not invariant:
        raise CheckpointError(f"checkpoint {path} was saved by a world-size-invariant run; resume it with {_FLAG} "
                              "(and the same training.global_batch_size)")
    if invariant and not saved:
        raise CheckpointError(f"checkpoint {path} was not saved by a world-size-invariant run, so no process count "
                              f"can continue it bit for bit; resume it without {_FLAG}, with its own process count")


def world_size_changed(path: Path, saved: int | None, current: int, config: JobConfig) -> bool:
    """The resume policy for another process count, knowing the mode: an invariant run goes on at any count
    (False), an ordinary one as ``checkpoint.on_world_size_change`` says (True: reseed; or it raises)."""
    invariant = config.parallelism.world_size_invariant
    check_checkpoint_mode(path, invariant)
    return not invariant and resume_policy.world_size_changed(path, saved, current,
                                                             config.checkpoint.on_world_size_change)


class InvariantRecord:
    """A Stateful checkpoint part: the batch shape of the invariant run (its presence marks the mode)."""

    def __init__(self, config: JobConfig) -> None:
        self.global_batch_size = config.training.global_batch_size
        self.local_batch_size = config.training.local_batch_size

    def state_dict(self) -> dict[str, Any]:
        return {"global_batch_size": torch.tensor(self.global_batch_size, dtype=torch.int64),
                "local_batch_size": torch.tensor(self.local_batch_size, dtype=torch.int64)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = int(state_dict["global_batch_size"]), int(state_dict["local_batch_size"])
        if saved != (self.global_batch_size, self.local_batch_size):
            raise CheckpointError(
                f"the checkpoint's invariant run had training.global_batch_size = {saved[0]} and "
                f"training.local_batch_size = {saved[1]}, this run {self.global_batch_size} and "
                f"{self.local_batch_size}; pass --training.global_batch_size {saved[0]} "
                f"--training.local_batch_size {saved[1]} to continue it bit for bit"
            )
