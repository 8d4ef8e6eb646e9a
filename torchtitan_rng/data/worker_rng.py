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
import struct
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info
from torchdata.stateful_dataloader import Stateful

from torchtitan_rng.data.sample_rng import SampleRandomDataset
from torchtitan_rng.rng import restore_host_rng


# The packed form: a header, then Python's 625 state words, NumPy's 624 keys (uint32 each), then torch's
# CPU generator state. Header: Python's version, has-gauss flag and gauss_next; NumPy's position, has-gauss
# flag and cached gaussian.
_HEADER = struct.Struct("<iBdiBd")
_PY_WORDS = struct.Struct("<625I")  # packs a tuple of ints faster than array or NumPy
_NP_KEYS = 624


def capture_worker_rng() -> np.ndarray:
    """This worker's Python, NumPy and torch CPU streams packed into one uint8 array.

    torchdata pickles a worker's snapshot into the queue message of a batch and diffs it against the
    previous one: a torch tensor there is moved to shared memory (about a millisecond), and every nested
    value is one more item to diff and pickle. One array pickles as its bytes; the checkpoint codec stores it
    as a tensor.
    """
    version, internal, gauss_next = random.getstate()
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    header = _HEADER.pack(version, gauss_next is not None, gauss_next or 0.0, pos, has_gauss, cached_gaussian)
    packed = b"".join((header, _PY_WORDS.pack(*internal), keys.astype("<u4", copy=False).tobytes(),
                       torch.get_rng_state().numpy().tobytes()))
    return np.frombuffer(bytearray(packed), dtype=np.uint8)  # writable: the codec makes a tensor of it


def restore_worker_rng(state: Any) -> None:
    """Put back what :func:`capture_worker_rng` took (an array, or a uint8 tensor from a checkpoint)."""
    if isinstance(state, dict):  # a checkpoint written before the packed form
        restore_host_rng(state)
        return
    raw = np.asarray(state, dtype=np.uint8).tobytes()
    version, has_py_gauss, py_gauss, pos, has_gauss, cached_gaussian = _HEADER.unpack_from(raw)
    start = _HEADER.size
    internal = _PY_WORDS.unpack_from(raw, start)
    start += _PY_WORDS.size
    keys = np.frombuffer(raw, dtype="<u4", count=_NP_KEYS, offset=start).astype(np.uint32)
    start += 4 * _NP_KEYS
    random.setstate((version, internal, py_gauss if has_py_gauss else None))
    np.random.set_state(("MT19937", keys, pos, has_gauss, cached_gaussian))
    torch.set_rng_state(torch.frombuffer(bytearray(raw[start:]), dtype=torch.uint8))


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
