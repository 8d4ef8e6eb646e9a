"""What world-size-invariant training requires of a run, and how it sets one up.

Checked before training, each refusal one line: a process count that divides the micro-batches per step
(``training.global_batch_size / training.local_batch_size``) and a dataset whose randomness comes from sample
keys (form 1). Every process runs one intra-op thread and torch's deterministic kernels, whatever the process
count: a multi-threaded CPU kernel may split a reduction by its thread count.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, IterableDataset

from torchtitan_rng import device as device_lib
from torchtitan_rng.config import ConfigError, Data, Training
from torchtitan_rng.data.worker_rng import uses_global_rng
from torchtitan_rng.parallel.invariant.step import Slots

_FLAG = "--parallelism.world_size_invariant"


def check_batch_layout(training: Training, data: Data, world: int, ranks: str = "processes") -> int:
    """The micro-batches per step; raises ConfigError when ``world`` processes (or the ``ranks`` named) cannot
    split them invariantly (checked by the launcher too, before any process starts)."""
    if training.global_batch_size < 1:
        raise ConfigError(f"{_FLAG} needs training.global_batch_size (samples per optimizer step, the same at "
                          "every process count); set it to a multiple of training.local_batch_size")
    if training.global_batch_size % training.local_batch_size:
        raise ConfigError(f"{_FLAG}: training.global_batch_size = {training.global_batch_size} is not a multiple "
                          f"of training.local_batch_size = {training.local_batch_size} (the micro-batch); "
                          "choose a multiple")
    micro_batches = training.global_batch_size // training.local_batch_size
    if micro_batches % world:
        counts = ", ".join(str(n) for n in range(1, micro_batches + 1) if micro_batches % n == 0)
        raise ConfigError(f"{_FLAG} needs a number of {ranks} that divides the {micro_batches} micro-batches "
                          f"per step (global / local batch size); got {world} {ranks}: use {counts}, or "
                          "change training.global_batch_size")
    if data.streaming:
        raise ConfigError(f"{_FLAG} places samples by index in a map-style dataset, and a streaming source has no "
                          "index; drop --data.streaming")
    return micro_batches


def plan_slots(training: Training, data: Data, rank: int, world: int, dataset: Dataset) -> Slots:
    """This data shard's share of each step; raises ConfigError when the run cannot be world-size-invariant."""
    micro_batches = check_batch_layout(training, data, world)
    if isinstance(dataset, IterableDataset):
        raise ConfigError(f"{_FLAG} places samples by index in a map-style dataset; {type(dataset).__name__} is "
                          "an IterableDataset")
    if uses_global_rng(dataset):
        raise ConfigError(f"{_FLAG} needs a dataset that derives its randomness from sample keys (form 1, "
                          f"SampleRandomDataset); {type(dataset).__name__} may draw from the global RNGs")
    return Slots(micro_batches=micro_batches, rank=rank, world=world)


def use_fixed_kernels() -> None:
    """The same kernels at every process count: one intra-op thread, deterministic algorithms."""
    torch.set_num_threads(1)
    device_lib.use_deterministic_algorithms()

