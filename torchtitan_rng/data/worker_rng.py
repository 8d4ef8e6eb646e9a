"""Form 2 of data randomness: carry the global RNGs of every dataloader worker across a resume.

A dataset whose ``__getitem__`` draws from the global RNGs (``torch.rand``, ``np.random``, ``random``)
runs, with workers, on each worker's own copy of them. StatefulDataLoader re-seeds a resumed worker from
``base_seed + worker_id``, so without help those streams restart from the start of the run while the sample
order is right (docs/design.md, "Randomness inside dataloader workers"). It does save a ``state_dict()`` of
the dataset *inside each worker* with that worker's snapshot and hands it back to the same worker on
resume: :class:`WorkerRNGDataset` puts the worker's Python, NumPy and torch CPU streams there.

In the main process (``num_workers = 0``) those streams are the training streams, which TrainState
captures at the step boundary and restores last; the wrapper then stores and restores nothing, so that
the two never disagree.

The worker streams depend on how samples are spread over workers, so a checkpoint of a wrapped dataset
resumes exactly only with the same ``data.num_workers`` (the dataloader checks it).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info
from torchdata.stateful_dataloader import Stateful

from torchtitan_rng.data.sample_rng import SampleRandomDataset
from torchtitan_rng.rng import restore_host_rng


def capture_worker_rng() -> dict[str, Any]:
    """This worker's Python, NumPy and torch CPU streams, in the form cheapest to send with a batch.

    torchdata pickles a worker's snapshot into the batch's queue message: a torch tensor there is moved
    to shared memory (about a millisecond per batch), while tuples of ints and numpy arrays pickle as
    plain bytes. The checkpoint codec stores both (an array as a tensor).
    """
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch_cpu": torch.get_rng_state().numpy()}


def restore_worker_rng(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_worker_rng` took (arrays come back from a checkpoint as tensors)."""
    if isinstance(state["python"], dict):  # a checkpoint written before the compact form
        restore_host_rng(state)
        return
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    name, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(torch.as_tensor(np.asarray(state["torch_cpu"], dtype=np.uint8)))


class WorkerRNGDataset(Dataset):
    """Wraps a map-style dataset; Stateful, so StatefulDataLoader saves and restores it per worker."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: int) -> Any:
        return self.dataset[key]

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if isinstance(self.dataset, Stateful):  # keep the wrapped dataset's own state, as torchdata would
            state["dataset"] = self.dataset.state_dict()
        if get_worker_info() is not None:
            state["worker_rng"] = capture_worker_rng()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "dataset" in state and isinstance(self.dataset, Stateful):
            self.dataset.load_state_dict(state["dataset"])
        # Only inside a worker: in the main process TrainState owns these streams.
        if "worker_rng" in state and get_worker_info() is not None:
            restore_worker_rng(state["worker_rng"])


def uses_global_rng(dataset: Dataset) -> bool:
    """False for datasets declared form 1 (they derive all randomness from sample keys)."""
    inner = dataset.dataset if isinstance(dataset, WorkerRNGDataset) else dataset
    return not isinstance(inner, SampleRandomDataset)


def with_worker_rng(dataset: Dataset, capture: bool) -> Dataset:
    """The dataset the loader should iterate: wrapped for form 2 unless it is form 1 or ``capture`` is off."""
    return WorkerRNGDataset(dataset) if capture and uses_global_rng(dataset) else dataset
