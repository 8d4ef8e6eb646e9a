"""A resumable, per-data-parallel-rank batch sampler that runs over epochs forever.

Sample keys: the sampler yields ``key = epoch * num_samples + index``. A dataset recovers the sample with
``split_sample_key`` and seeds its per-sample randomness from the whole key, so the same index draws
different augmentations in different epochs and the same ones after a resume.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from torchtitan_rng.rng import stream_generator


def split_sample_key(key: int, num_samples: int) -> tuple[int, int]:
    """(epoch, index) of a sample key."""
    return divmod(int(key), num_samples)


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The order of the samples in ``epoch``: a permutation from the run-rooted "sampler" stream (the same for
    every rank and process count), or the identity without shuffling."""
    if not shuffle:
        return torch.arange(num_samples)
    return torch.randperm(num_samples, generator=stream_generator("sampler", seed, epoch))


class ResumableBatchSampler:
    """Yields lists of sample keys for one data-parallel rank; its own iterator, and Stateful.

    Every rank computes the same permutation of an epoch (derived from ``(seed, "sampler", epoch)``) and
    takes every ``dp_world``-th entry, dropping the tail so that all ranks see equally many samples.
    """

    def __init__(self, num_samples: int, batch_size: int, dp_rank: int, dp_world: int, seed: int,
                 shuffle: bool = True) -> None:
        if num_samples < dp_world:
            raise ValueError(f"{num_samples} samples cannot be split over {dp_world} data-parallel ranks")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # samples of this rank already handed out in the current epoch
        self._epoch_keys: list[int] | None = None

    def _keys_of_epoch(self) -> list[int]:
        if self._epoch_keys is None:
            order = epoch_order(self.num_samples, self.seed, self.epoch, self.shuffle)
            per_rank = self.num_samples // self.dp_world
            mine = order[self.dp_rank :: self.dp_world][:per_rank]
            self._epoch_keys = (mine + self.epoch * self.num_samples).tolist()
        return self._epoch_keys

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        batch: list[int] = []
        while len(batch) < self.batch_size:
            keys = self._keys_of_epoch()
            if self.position >= len(keys):
                self.epoch, self.position, self._epoch_keys = self.epoch + 1, 0, None
                continue
            take = min(self.batch_size - len(batch), len(keys) - self.position)
            batch.extend(keys[self.position : self.position + take])
            self.position += take
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position, self._epoch_keys = int(state["epoch"]), int(state["position"]), None
