"""``metrics.log_samples``: the sample keys of every micro-batch of a step, in its loss-log line.

Each rank takes the keys out of the batches it loads (``data/sample_keys.py``) and keeps them per step; at the
loss log's sync points (every ``metrics.log_freq`` steps, each checkpoint, a stop, the last step) the ranks
gather them in one collective and rank 0 writes them as ``"samples"``: one list of keys per micro-batch,
rank-major (rank r's i-th micro-batch of the step at ``r * micro_batches_per_rank + i``). In the
world-size-invariant mode slots are dealt round-robin (shard r's i-th micro-batch is slot ``i * D + r`` of D
data shards), so there the position is not the slot. Nothing is read or sent between two sync points. A run
that fails between two writes its queued lines without their samples.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch.distributed as dist

from torchtitan_rng.data.sample_keys import take_keys

SAMPLES_FIELD = "samples"


class SampleLog:
    """One rank's record of the keys it loaded, step by step, until the next sync point."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
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
        gathered: list[Any] = [self._steps]
        if self.world_size > 1:
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, self._steps)
        if self.rank == 0:
            for step, line in self._lines.items():
                line[SAMPLES_FIELD] = [keys for per_rank in gathered for keys in per_rank[step]]
        self._steps, self._lines = {}, {}
