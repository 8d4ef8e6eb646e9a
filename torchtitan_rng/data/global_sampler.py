"""A batch sampler that places data by global position, the same at every process count.

The samples of a run form one stream: epoch after epoch, each the permutation derived from
``(seed, "sampler", epoch)`` (the same permutation :class:`~torchtitan_rng.data.sampler.ResumableBatchSampler`
uses), nothing dropped. Step ``t`` (0-based) takes ``micro_batches`` micro-batches of ``batch_size`` samples
from it; micro-batch slot ``j`` of step ``t`` holds stream positions ``(t * micro_batches + j) * batch_size``
onward, whatever the number of processes. Rank ``r`` of ``world`` processes takes the contiguous block of
slots ``r * k .. r * k + k - 1`` with ``k = micro_batches / world``.

Its state is the global position (steps done, and the slot inside this rank's block), so at a step
boundary every rank holds the same state and a checkpoint of 4 processes positions 2 or 1 of them.
"""

from __future__ import annotations

from typing import Any, Iterator


from torchtitan_rng.data.sampler import epoch_order


class GlobalBatchSampler:
    """Yields this rank's micro-batches of sample keys (``epoch * num_samples + index``); Stateful."""

    def __init__(self, num_samples: int, batch_size: int, micro_batches: int, rank: int, world: int, seed: int,
                 shuffle: bool = True) -> None:
        if micro_batches % world:
            raise ValueError(f"{micro_batches} micro-batches per step cannot be split over {world} processes")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.micro_batches = micro_batches
        self.per_rank = micro_batches // world
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.step = 0  # steps whose micro-batches this rank has all handed out
        self.slot = 0  # micro-batches of the current step handed out (0 .. per_rank - 1)
        self._epoch: int | None = None
        self._order: list[int] = []

    def _key_at(self, position: int) -> int:
        """The sample key at a position of the global stream."""
        epoch, offset = divmod(position, self.num_samples)
        if epoch != self._epoch:
            self._epoch, self._order = epoch, epoch_order(self.num_samples, self.seed, epoch, self.shuffle).tolist()
        return epoch * self.num_samples + self._order[offset]

    def keys_of(self, step: int, slot: int) -> list[int]:
        """The sample keys of global micro-batch ``slot`` of 0-based step ``step``."""
        start = (step * self.micro_batches + slot) * self.batch_size
        return [self._key_at(position) for position in range(start, start + self.batch_size)]

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        keys = self.keys_of(self.step, self.rank * self.per_rank + self.slot)
        self.slot += 1
        if self.slot == self.per_rank:
            self.step, self.slot = self.step + 1, 0
        return keys

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "slot": self.slot}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.slot = int(state["step"]), int(state["slot"])
