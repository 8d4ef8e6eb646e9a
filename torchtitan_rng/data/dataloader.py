"""A StatefulDataLoader with its own generator, a per-rank resumable sampler, and a per-rank checkpoint key."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan_rng.data.sampler import ResumableBatchSampler
from torchtitan_rng.rng import derive_seed
from torchtitan_rng.state_codec import decode_state, encode_state


# torchdata 0.11 calls a deprecated torch API at every loader construction; the warning is not ours to fix.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")


def dp_rank_key(dp_rank: int) -> str:
    return f"dp_rank_{dp_rank}"


class ResumableDataLoader(StatefulDataLoader):
    """Its state lives under ``dp_rank_{r}`` so that every data-parallel rank loads its own position.

    The loader owns a generator seeded from ``(seed, "dataloader", dp_rank)``: without one, a DataLoader
    draws its worker base seed from the global CPU RNG at every ``iter()``, shifting the training stream.
    """

    def __init__(self, dataset: Dataset, *, batch_size: int, dp_rank: int, dp_world: int, seed: int,
                 num_workers: int = 0, prefetch_factor: int = 2, snapshot_every_n_steps: int = 1,
                 shuffle: bool = True) -> None:
        self.dp_rank = dp_rank
        self.num_workers_configured = num_workers
        sampler = ResumableBatchSampler(len(dataset), batch_size, dp_rank, dp_world, seed, shuffle=shuffle)
        super().__init__(
            dataset,
            batch_sampler=sampler,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            generator=torch.Generator().manual_seed(derive_seed(seed, "dataloader", dp_rank)),
            snapshot_every_n_steps=snapshot_every_n_steps,
        )

    def state_dict(self) -> dict[str, Any]:
        return {dp_rank_key(self.dp_rank): encode_state(super().state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(decode_state(state_dict[dp_rank_key(self.dp_rank)]))
