"""``metrics.log_samples``: the sample keys of every micro-batch of a step, in its loss-log line.

Each rank takes the keys out of the batches it loads (``data/sample_keys.py``) and keeps them per step; at the
loss log's sync points (every ``metrics.log_freq`` steps, each checkpoint, a stop, the last step) the ranks
gather them in one collective and rank 0 writes them as ``"samples"``: one list of keys per loader batch of the
step, in slot order (the plan's ``slot``: shard-major in the ordinary mode, the mode's slot in the
world-size-invariant mode, where it is the same at any process count), each data shard's once (the ranks of one
shard, a pipeline's stages, load the same batches). ``python -m torchtitan_rng.samples`` and ``replay`` number
micro-batches the same way. Nothing is read or sent between two sync points. A run that fails between two writes
its queued lines without their samples.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch.distributed as dist

from torchtitan_rng.data.sample_keys import take_keys

SAMPLES_FIELD = "samples"
# (data shard, index of its loader batch in the step): the batch's number in the step (``ParallelPlan.slot``).
SlotOf = Callable[[int, int], int]


class SampleLog:
    """One rank's record of the keys it loaded, step by step, until the next sync point; ``shard``: its data
    shard."""

    def __init__(self, rank: int, world_size: int, shard: int, slot_of: SlotOf) -> None:
        self.rank, self.world_size, self.shard, self.slot_of = rank, world_size, shard, slot_of
        self._current: list[list[int]] = []
        self._steps: dict[int, list[list[int]]] = {}
        self._lines: dict[int, dict[str, Any]] = {}  # rank 0: the loss-log lines still to be given their samples

    def batches(self, loader_iter: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """The loader's batches, each with its keys taken out and noted for the step being trained."""
        for batch in loader_iter:
            self._current.append(take_keys(batch))
            yield batch

    def step_done(self, step: int, line: dict[str, Any]) -> None:
        """The step's micro-batches are all loaded; ``line`` is its loss-log line (rank 0), filled at :meth:`sync`."""
        self._steps[step], self._current = self._current, []
        if self.rank == 0:
            self._lines[step] = line

    def sync(self) -> None:
        """Every rank, at a sync point: gather the keys noted since the last one; rank 0 puts them in the lines."""
        gathered: list[Any] = [(self.shard, self._steps)]
        if self.world_size > 1:
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, (self.shard, self._steps))
        if self.rank == 0:
            for step, line in self._lines.items():
                line[SAMPLES_FIELD] = in_slot_order([(shard, steps[step]) for shard, steps in gathered], self.slot_of)
        self._steps, self._lines = {}, {}


def in_slot_order(loaded: list[tuple[int, list[list[int]]]], slot_of: SlotOf) -> list[list[int]]:
    """Every rank's (data shard, keys of its loader batches of a step), rank by rank: each shard's batches once
    (its first rank's), by their slot."""
    shards: dict[int, list[list[int]]] = {}
    for shard, batches in loaded:
        shards.setdefault(shard, batches)
    placed = sorted((slot_of(shard, index), keys) for shard, batches in shards.items()
                    for index, keys in enumerate(batches))
    return [keys for _, keys in placed]
