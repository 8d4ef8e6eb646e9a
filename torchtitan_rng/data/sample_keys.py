"""Which samples a batch holds (``metrics.log_samples``): each sample carries its key through the loader.

A sample key is ``epoch * len(dataset) + index`` (``sampler.py``). :func:`with_sample_keys` wraps a map-style
dataset so that every sample (a dict) also holds its key under ``SAMPLE_KEYS``; the default collate makes them
one int64 tensor per batch, and :func:`take_keys` removes it from the batch before the model sees it. The keys
come back with the batches the workers made, so what is logged is what was loaded, prefetching, workers and
resumes included.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import Stateful

from torchtitan_rng.errors import ConfigError

SAMPLE_KEYS = "sample_keys"


class KeyedDataset(Dataset):
    """``dataset``'s samples, each with its key added (a dataset of dict samples)."""

    adds_no_randomness = True

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: int) -> dict[str, Any]:
        sample = self.dataset[key]
        if not isinstance(sample, dict):
            raise ConfigError(f"metrics.log_samples adds each sample's key to it, and {type(self.dataset).__name__} "
                              f"returns a {type(sample).__name__}, not a dict; turn metrics.log_samples off")
        return {**sample, SAMPLE_KEYS: int(key)}


class _StatefulKeyedDataset(KeyedDataset):
    """The same around a Stateful dataset, whose state the loader saves per worker: it stays reachable."""

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)  # type: ignore[attr-defined]


def with_sample_keys(dataset: Dataset) -> KeyedDataset:
    return _StatefulKeyedDataset(dataset) if isinstance(dataset, Stateful) else KeyedDataset(dataset)


def take_keys(batch: dict[str, Any]) -> list[int]:
    """The keys of a batch of a :class:`KeyedDataset`, removed from it (the model never sees them)."""
    keys: torch.Tensor = batch.pop(SAMPLE_KEYS)
    return keys.tolist()
