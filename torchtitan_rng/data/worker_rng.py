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

import ctypes
import random
import struct
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import Stateful

from torchtitan_rng.data.sample_rng import SampleRandomDataset
from torchtitan_rng.rng import restore_host_rng


# The packed form: a header, then Python's 625 state words, NumPy's 624 keys (uint32 each), then torch's
# CPU generator state. Header: Python's version, has-gauss flag and gauss_next; NumPy's position, has-gauss
# flag and cached gaussian.
_HEADER = struct.Struct("<iBdiBd")
_PY_WORDS = struct.Struct("<625I")  # packs a tuple of ints faster than array or NumPy
_NP_KEYS = 624


class _NumpyGlobalStream:
    """NumPy's legacy global stream (``np.random.*``) read in microseconds.

    ``np.random.get_state()`` copies the 624 keys one Python call at a time (~55 us, most of a capture).
    The keys and position are MT19937's C state, at the address its documented ``ctypes`` interface gives;
    the cached gaussian (flag and value) lives in the RandomState object, at offsets found once per
    process on private RandomState objects set to marked values. Both are checked once against
    ``get_state()``; where a reading does not match (another NumPy layout), ``get_state()`` it is.
    """

    _MARKS = (1.2345678901234567, -7.654321098765432)

    def __init__(self) -> None:
        self.gauss_offsets: tuple[int, int] | None = None
        self.fast: bool | None = None  # None until checked, once per process

    @staticmethod
    def _memory(state: np.random.RandomState) -> bytes:
        return ctypes.string_at(id(state), type(state).__basicsize__)

    @staticmethod
    def _marked(has_gauss: int, gauss: float) -> np.random.RandomState:
        state = np.random.RandomState(0)
        state.set_state(("MT19937", state.get_state()[1], 624, has_gauss, gauss))
        return state

    def _find_gauss_offsets(self) -> tuple[int, int] | None:
        """(flag offset, value offset) of the cached gaussian in a RandomState, if marked objects show them."""
        plain = self._memory(self._marked(0, 0.0))
        marked = self._memory(self._marked(1, self._MARKS[0]))
        at = marked.find(struct.pack("<d", self._MARKS[0]))
        flags = [offset for offset in range(0, max(at, 0), 4)
                 if plain[offset:offset + 4] == b"\0\0\0\0" and marked[offset:offset + 4] == b"\1\0\0\0"]
        return (flags[-1], at) if at > 0 and flags else None

    def _read_fast(self, state: np.random.RandomState) -> tuple[bytes, int, int, float]:
        assert self.gauss_offsets is not None
        c_state = ctypes.string_at(state._bit_generator.ctypes.state_address, 4 * _NP_KEYS + 4)
        memory = self._memory(state)
        flag_at, gauss_at = self.gauss_offsets
        (has_gauss,) = struct.unpack_from("<i", memory, flag_at)
        (gauss,) = struct.unpack_from("<d", memory, gauss_at)
        return c_state[:-4], struct.unpack("<i", c_state[-4:])[0], has_gauss, gauss

    def _check(self) -> bool:
        self.gauss_offsets = self._find_gauss_offsets()
        if self.gauss_offsets is None:
            return False
        samples = [self._marked(1, self._MARKS[1]), np.random.RandomState(1), np.random.mtrand._rand]
        return all(self._read_fast(state) == self._slow(state) for state in samples)

    @staticmethod
    def _slow(state: np.random.RandomState) -> tuple[bytes, int, int, float]:
        _, keys, pos, has_gauss, gauss = state.get_state()
        return keys.astype("<u4", copy=False).tobytes(), pos, has_gauss, gauss

    def read(self) -> tuple[bytes, int, int, float]:
        """(keys as little-endian uint32 bytes, position, has-gauss flag, cached gaussian)."""
        if self.fast is None:
            self.fast = self._check()
        state = np.random.mtrand._rand
        return self._read_fast(state) if self.fast else self._slow(state)


_numpy_stream = _NumpyGlobalStream()


def capture_worker_rng() -> bytes:
    """This worker's Python, NumPy and torch CPU streams packed into one ``bytes`` value.

    torchdata pickles a worker's snapshot into the queue message of a batch and diffs it against the
    previous one: bytes pickle as themselves and compare with one memcmp, where a tensor would move to
    shared memory (about a millisecond) and every nested value is one more item to diff and pickle. The
    checkpoint codec stores bytes as they are.
    """
    version, internal, gauss_next = random.getstate()
    keys, pos, has_gauss, cached_gaussian = _numpy_stream.read()
    header = _HEADER.pack(version, gauss_next is not None, gauss_next or 0.0, pos, has_gauss, cached_gaussian)
    return b"".join((header, _PY_WORDS.pack(*internal), keys, torch.get_rng_state().numpy().tobytes()))


def restore_worker_rng(state: Any) -> None:
    """Put back what :func:`capture_worker_rng` took (bytes; a uint8 array or tensor from older checkpoints)."""
    if isinstance(state, dict):  # a checkpoint written before the packed form
        restore_host_rng(state)
        return
    raw = state if isinstance(state, bytes) else np.asarray(state, dtype=np.uint8).tobytes()
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

    adds_no_randomness = True

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


class WorkerRNGIterableDataset(IterableDataset):
    """Wraps an iterable dataset (one that draws inside ``__iter__``, such as a streaming loader's); Stateful,
    so StatefulDataLoader saves and restores each worker's streams with that worker's dataset state.

    The streams sit beside the wrapped dataset's own keys (``worker_rng``), so a checkpoint reads the same to
    the dataset without the wrapper (its ``load_state_dict`` is handed its own keys), and a checkpoint saved
    without the wrapper loads into it (the worker then keeps the streams its loader seeded)."""

    adds_no_randomness = True

    def __init__(self, dataset: IterableDataset) -> None:
        self.dataset = dataset

    def __iter__(self) -> Any:
        return iter(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling): no recursion through the line below
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def state_dict(self) -> dict[str, Any]:
        state = dict(self.dataset.state_dict()) if isinstance(self.dataset, Stateful) else {}
        if get_worker_info() is not None:
            state["worker_rng"] = capture_worker_rng()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        own = {key: value for key, value in state.items() if key != "worker_rng"}
        if isinstance(self.dataset, Stateful):
            self.dataset.load_state_dict(own)
        # Only inside a worker: in the main process the training streams are restored by the trainer.
        if "worker_rng" in state and get_worker_info() is not None:
            restore_worker_rng(state["worker_rng"])


def uses_global_rng(dataset: Dataset) -> bool:
    """False for datasets declared form 1 (they derive all randomness from sample keys)."""
    inner = dataset
    while getattr(inner, "adds_no_randomness", False):  # a wrapper of ours: what it wraps decides
        inner = inner.dataset
    return not isinstance(inner, SampleRandomDataset)


def with_worker_rng(dataset: Dataset, capture: bool) -> Dataset:
    """The dataset the loader should iterate: wrapped for form 2 unless it is form 1 or ``capture`` is off."""
    return WorkerRNGDataset(dataset) if capture and uses_global_rng(dataset) else dataset
