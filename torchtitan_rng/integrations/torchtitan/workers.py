"""Each loader worker's streams (Python, NumPy, torch CPU), carried in the loader's per-worker state."""

from __future__ import annotations

from typing import Any

from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan_rng.data.worker_rng import WorkerRNGDataset, WorkerRNGIterableDataset, uses_global_rng


def carry_worker_streams(loader: Any, carry: bool = True) -> str | None:
    """Let each of ``loader``'s workers carry its streams across a resume; the WARNING line where they are not.

    A StatefulDataLoader saves each worker's dataset state, taken inside the worker after each batch, and hands
    it back to the same worker at a resume, after the worker has seeded its streams from the loader's seed: the
    dataset, wrapped (``WorkerRNGIterableDataset``, or ``WorkerRNGDataset`` for a map-style one), puts the
    worker's streams into that state and back. Nothing to do without workers (the dataset draws from the
    training streams) or for a dataset that derives its randomness per sample."""
    workers = getattr(loader, "num_workers", 0)
    dataset = getattr(loader, "dataset", None)
    if workers == 0 or dataset is None or not uses_global_rng(dataset):
        return None
    why = (f"the dataloader ({type(loader).__name__}) is not a torchdata StatefulDataLoader, which saves its "
           "workers' state" if not isinstance(loader, StatefulDataLoader) else
           "worker_streams is off" if not carry else None)
    if why is not None:
        return (f"torchtitan_rng: the dataloader runs {workers} worker{'s' if workers != 1 else ''} and {why}: "
                "what its dataset draws at random inside a worker restarts from the loader's seed at a resume, "
                "so a resume is not exact if it draws")
    wrapped = WorkerRNGIterableDataset(dataset) if isinstance(dataset, IterableDataset) else WorkerRNGDataset(dataset)
    # DataLoader refuses a new dataset once built; nothing has iterated it yet, and the wrapper is of the same
    # kind (iterable or map-style), the one thing the loader derived from it.
    object.__setattr__(loader, "dataset", wrapped)
    return None
