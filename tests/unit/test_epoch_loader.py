"""EpochLoader, the train loader both integrations hand their framework: closing it (the end of ``train()`` /
``fit()``) keeps its position, so a checkpoint saved after training resumes where training stopped; pickled
mid-epoch (inside a pickled Trainer), its copy resumes where it was and the original goes on."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils.data import Dataset

from torchtitan_rng.integrations.loader import EpochLoader, exact_resume_loader


class Numbers(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


def _batches(loader: EpochLoader, count: int) -> list[list[int]]:
    return [next(loader).tolist() for _ in range(count)]


def _trained_three_of_five(workers: int) -> tuple[EpochLoader, list[list[int]]]:
    """A loader that gave 3 batches, and the 5 an uninterrupted one gives."""
    reference = exact_resume_loader(Numbers(), batch_size=2, seed=0, num_workers=workers)
    expected = _batches(reference, 5)
    reference.close()
    trained = exact_resume_loader(Numbers(), batch_size=2, seed=0, num_workers=workers)
    assert _batches(trained, 3) == expected[:3]
    return trained, expected


@pytest.mark.parametrize("workers", [0, 2])
def test_a_closed_loaders_state_is_where_it_stopped(workers: int) -> None:
    trained, expected = _trained_three_of_five(workers)
    trained.close()
    resumed = exact_resume_loader(Numbers(), batch_size=2, seed=0, num_workers=workers)
    resumed.load_state_dict(trained.state_dict())
    assert _batches(resumed, 2) == expected[3:]
    resumed.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_pickled_mid_epoch_resumes_where_it_was(workers: int) -> None:
    trained, expected = _trained_three_of_five(workers)
    copy = pickle.loads(pickle.dumps(trained))
    assert _batches(copy, 2) == expected[3:]
    assert _batches(trained, 2) == expected[3:]
    copy.close()
    trained.close()
