"""Benchmark 5: dataloader throughput with worker RNG capture on vs. off (target: on/off >= 0.97).

The dataset is the debug config's, with a random crop drawn from the global torch RNG inside
``__getitem__`` (form 2 of data randomness: the case worker RNG capture exists for). With capture on, each
batch that carries a worker snapshot also carries that worker's Python, NumPy and torch streams
(``data.capture_worker_rng``); off, it does not. Three cadences: the worst case, a snapshot with every batch
(``data.snapshot_every_n_steps = 1``), the default of the trainer and of ``ExactResume`` (a snapshot every
save interval: ``checkpoint.interval`` steps, 5 in the debug config) and an interval of 100. Rounds
alternate on/off; each round reads the same number of batches through fresh workers. Besides throughput
(which moves with other load on the machine), the CPU time of every thread of the main process and its
workers per batch: the cost itself, less disturbed by that load.

    python -m bench.dataloader_throughput [--quick] [--workers 2]
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from bench.common import config_for, median, parser, spread, table
from torchtitan_rng.config import snapshot_every_n_steps
from torchtitan_rng.data.dataloader import ResumableDataLoader
from torchtitan_rng.models import get_train_spec

from torchtitan_rng.data.worker_rng import with_worker_rng


class GlobalRandomCrop(Dataset):
    """A user's dataset that draws from the global RNG (so a worker's stream position matters)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: int) -> dict[str, Any]:
        sample = self.dataset[key]
        cut = int(torch.randint(0, 4, (1,)))
        return {name: value.roll(cut) for name, value in sample.items()}


def _cpu_seconds(pids: list[int]) -> float:
    """CPU time used so far by every thread of these processes (a worker pickles its batches in a queue
    feeder thread), from /proc with nanosecond resolution."""
    return sum(int(stat.read_text().split()[0]) for pid in pids
               for stat in Path(f"/proc/{pid}/task").glob("*/schedstat")) / 1e9


def read_batches(dataset: Dataset, capture: bool, workers: int, batches: int, batch_size: int,
                 snapshot_every: int) -> tuple[float, float]:
    """(batches per second, CPU milliseconds per batch of this process and its workers together)."""
    loader = ResumableDataLoader(with_worker_rng(dataset, capture), batch_size=batch_size, dp_rank=0, dp_world=1,
                                 seed=0, num_workers=workers, snapshot_every_n_steps=snapshot_every)
    iterator = iter(loader)
    next(iterator)  # the workers are up
    pids = [worker.pid for worker in loader._iterator._workers]
    pids.append(os.getpid())
    start, cpu_start = time.perf_counter(), _cpu_seconds(pids)
    for _ in range(batches):
        next(iterator)
    elapsed = time.perf_counter() - start
    cpu = _cpu_seconds(pids) - cpu_start
    del iterator
    return batches / elapsed, cpu / batches * 1000


def main() -> None:
    args = parser(__doc__.splitlines()[0], workers=True)
    args = args.parse_args()
    rounds, batches = (7, 400) if args.quick else (15, 1000)
    config = config_for("--data.num_samples", "0")
    dataset = GlobalRandomCrop(get_train_spec(config).build_dataset(config))
    interval = snapshot_every_n_steps(config)
    cadences = {"every batch": 1, f"every {interval} batches (trainer default: checkpoint.interval)": interval,
                "every 100 batches (checkpoint.interval 100)": 100}
    rates: dict[tuple[str, bool], list[float]] = {(name, on): [] for name in cadences for on in (True, False)}
    cpu: dict[tuple[str, bool], list[float]] = {(name, on): [] for name in cadences for on in (True, False)}
    for index in range(rounds):
        for name, every in cadences.items():
            for capture in (True, False) if index % 2 == 0 else (False, True):  # neither always goes first
                rate, cpu_ms = read_batches(dataset, capture, args.workers, batches, config.training.local_batch_size,
                                            every)
                rates[name, capture].append(rate)
                cpu[name, capture].append(cpu_ms)
    rows = []
    for name in cadences:
        on, off = rates[name, True], rates[name, False]
        # Each round's on and off ran back to back: their ratio cancels the machine's slower drifts in load.
        paired = [a / b for a, b in zip(on, off)]
        cpu_on, cpu_off = median(cpu[name, True]), median(cpu[name, False])
        rows.append([name, f"{median(on):.0f} / {median(off):.0f}", f"**{median(paired):.3f}** ({spread(paired)})",
                     f"{cpu_on:.3f} / {cpu_off:.3f}", f"**{cpu_off / cpu_on:.3f}**"])
    table(
        f"Benchmark 5: dataloader throughput, worker RNG capture on vs off ({args.workers} workers, "
        f"batch {config.training.local_batch_size}, {rounds} rounds x {batches} batches; target on/off >= 0.97)",
        ["snapshot", "batches/s on / off (median)", "throughput on/off, median of rounds (min..max)",
         "CPU ms per batch on / off (main + workers)", "off/on CPU per batch"],
        rows,
    )

if __name__ == "__main__":
    main()
