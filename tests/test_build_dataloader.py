"""build_dataloader: what a dataset receives, and the DataLoader arguments it accepts and forwards."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

import torchtitan_rng


class KeyEcho(torchtitan_rng.SampleRandomDataset):
    def __init__(self) -> None:
        super().__init__(0, "echo")

    def __len__(self) -> int:
        return 10

    def __getitem__(self, key: int) -> int:
        return key


def test_loader_hands_indices_or_sample_keys() -> None:
    """A plain dataset gets indices in range(len) in every epoch; a SampleRandomDataset gets sample keys."""
    batches = iter(torchtitan_rng.build_dataloader(TensorDataset(torch.arange(10)), batch_size=5, seed=0))
    epochs = [torch.cat([next(batches)[0], next(batches)[0]]) for _ in range(3)]
    for seen in epochs:
        assert torch.equal(seen.sort().values, torch.arange(10))
    assert not torch.equal(epochs[0], epochs[1])  # a new permutation each epoch
    keys = iter(torchtitan_rng.build_dataloader(KeyEcho(), batch_size=5, seed=0))
    second_epoch = torch.cat([next(keys) for _ in range(4)][2:])
    assert torch.equal(second_epoch.sort().values, torch.arange(10, 20))
