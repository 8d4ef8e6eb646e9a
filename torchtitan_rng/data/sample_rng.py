"""Form 1 of data randomness: a generator per sample, derived from (seed, purpose, sample key).

The sampler hands a dataset sample keys ``epoch * len(dataset) + index`` (see ``sampler.py``). Seeding every
random draw of ``__getitem__`` from the whole key makes a sample a pure function of the key: the same
augmentation whichever worker makes it, however far the loader prefetched and however many workers there
are, a different one for the same index in the next epoch, and nothing to save in a checkpoint.

Write a dataset either with the two functions or by subclassing :class:`SampleRandomDataset`; the
subclass also tells the trainer that the dataset needs no worker-RNG capture (form 2) and may resume with
another ``data.num_workers``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from torchtitan_rng.data.sampler import split_sample_key
from torchtitan_rng.rng import derived_generator, derived_numpy_generator


def sample_generator(seed: int, key: int, purpose: str = "sample") -> torch.Generator:
    """The torch generator of sample ``key`` for one ``purpose`` (distinct purposes: independent streams)."""
    return derived_generator(seed, purpose, int(key))


def sample_numpy_generator(seed: int, key: int, purpose: str = "sample") -> np.random.Generator:
    """The NumPy twin of :func:`sample_generator`."""
    return derived_numpy_generator(seed, purpose, int(key))


class SampleRandomDataset(Dataset):
    """A map-style dataset whose every random draw comes from :meth:`sample_generator` (or its NumPy twin).

    Subclasses call ``super().__init__(seed, purpose)``, implement ``__len__`` (samples per epoch) and
    ``__getitem__(key)``, and never touch the global RNGs there (``torch.rand(...)`` without a generator,
    ``np.random.*``, ``random.*``).
    """

    def __init__(self, seed: int, purpose: str) -> None:
        self.seed = seed
        self.purpose = purpose

    def epoch_and_index(self, key: int) -> tuple[int, int]:
        return split_sample_key(key, len(self))

    def sample_generator(self, key: int) -> torch.Generator:
        return sample_generator(self.seed, key, self.purpose)

    def sample_numpy_generator(self, key: int) -> np.random.Generator:
        return sample_numpy_generator(self.seed, key, self.purpose)
