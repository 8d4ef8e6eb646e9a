"""A StatefulDataLoader with its own generator, a per-rank resumable sampler, and a per-rank checkpoint key."""

from __future__ import annotations

import sys
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from torch.utils.data import Dataset, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.stateful_dataloader import (
    _SAMPLER_ITER_STATE,
    _StatefulMultiProcessingDataLoaderIter as _MultiProcessIter,
)

from torchtitan_rng.checkpoint.layout import dp_rank_key
from torchtitan_rng.config import ConfigError
from torchtitan_rng.signals import ignore_checkpoint_signals
from torchtitan_rng.data.global_sampler import GlobalBatchSampler
from torchtitan_rng.data.sampler import ResumableBatchSampler
from torchtitan_rng.data.worker_rng import uses_global_rng
from torchtitan_rng.rng import stream_generator
from torchtitan_rng.checkpoint.codec import decode_state, encode_state


@contextmanager
def built_quietly() -> Iterator[None]:
    """Around a StatefulDataLoader's construction: torchdata 0.11 calls a deprecated torch API there
    (``torch.set_vital``), a warning that is neither ours nor the user's to fix."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        yield


def map_style_problem(dataset: Any) -> str | None:
    """None when ``dataset`` is map-style (the sampler's position is what resumes); else one line saying why not."""
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        kind = "an IterableDataset" if isinstance(dataset, IterableDataset) else "not map-style"
        return (f"the dataset is {kind} ({type(dataset).__name__}): a resumable dataloader needs a map-style dataset "
                "(__len__ and __getitem__(index)), whose order it draws and saves per rank; index your data in a "
                "torch.utils.data.Dataset")
    return None


def require_map_style(dataset: Any) -> None:
    """A TypeError in one line unless ``dataset`` is map-style."""
    problem = map_style_problem(dataset)
    if problem is not None:
        raise TypeError(problem)


class _WorkerInit:
    """Ours first (a worker ignores the signals its rank checkpoints on), then the user's ``worker_init_fn``.

    A class, not a closure, so that it pickles for the ``spawn`` and ``forkserver`` contexts.
    """

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        ignore_checkpoint_signals(worker_id)
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _sampler_after_last_batch(loader_state: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """(sampler state, batches still to skip) at the last batch the saved loader yielded.

    The live sampler runs ahead of training by the prefetched batches; torchdata's state holds it as it
    was when the last yielded batch was drawn: directly with no workers, else in the last snapshot, which
    ``snapshot_every_n_steps > 1`` leaves some batches behind.
    """
    if _MultiProcessIter._SNAPSHOT not in loader_state:
        return loader_state[_SAMPLER_ITER_STATE], 0
    main = loader_state[_MultiProcessIter._SNAPSHOT][_MultiProcessIter._MAIN_SNAPSHOT]
    return main[_SAMPLER_ITER_STATE], int(loader_state[_MultiProcessIter._STEPS_SINCE_SNAPSHOT])


class ResumableDataLoader(StatefulDataLoader):
    """Its state lives under ``dp_rank_{r}`` so that every data-parallel rank loads its own position.

    The loader owns a generator seeded from ``(seed, "dataloader", dp_rank)``: without one, a DataLoader
    draws its worker base seed from the global CPU RNG at every ``iter()``, shifting the training stream.

    Resuming with another ``num_workers`` than the checkpoint's is exact when the dataset derives all its
    randomness from sample keys (form 1): only the sampler's position is carried over. A dataset that may
    draw from the global RNGs (form 2) is refused with :class:`ConfigError` unless
    ``on_num_workers_change="warn"``, which continues with fresh worker streams.
    """

    def __init__(self, dataset: Dataset, *, batch_size: int, dp_rank: int, dp_world: int, seed: int,
                 num_workers: int = 0, prefetch_factor: int = 2, snapshot_every_n_steps: int = 1,
                 shuffle: bool = True, on_num_workers_change: str = "error",
                 collate_fn: Callable[[list[Any]], Any] | None = None, pin_memory: bool = False,
                 drop_last: bool = True, timeout: float = 0,
                 worker_init_fn: Callable[[int], None] | None = None, multiprocessing_context: Any = None,
                 persistent_workers: bool = False, batch_sampler: GlobalBatchSampler | None = None) -> None:
        require_map_style(dataset)
        if not drop_last:
            # The batch sampler runs over epochs without end, so an epoch's tail opens the next batch.
            raise ValueError(
                "drop_last=False asks for a partial last batch per epoch, and this loader makes none: every batch "
                "is full (a batch may span two epochs); leave drop_last at True"
            )
        self.dp_rank = dp_rank
        self.num_workers_configured = num_workers
        self.on_num_workers_change = on_num_workers_change
        self.uses_global_rng = uses_global_rng(dataset)
        # A sampler handed in (world-size-invariant training) replaces the per-rank one.
        sampler = batch_sampler or ResumableBatchSampler(len(dataset), batch_size, dp_rank, dp_world, seed,
                                                         shuffle=shuffle)
        with built_quietly():
            super().__init__(
                dataset,
                batch_sampler=sampler,
                num_workers=num_workers,
                prefetch_factor=prefetch_factor if num_workers > 0 else None,
                generator=stream_generator("dataloader", seed, dp_rank),
                snapshot_every_n_steps=snapshot_every_n_steps,
                # A cluster signals every process of a job; the rank decides when to stop, not its workers.
                worker_init_fn=_WorkerInit(worker_init_fn),
                collate_fn=collate_fn,
                pin_memory=pin_memory,
                timeout=timeout,
                multiprocessing_context=multiprocessing_context,
                persistent_workers=persistent_workers,
            )
        # Batches handed out since construction or the last load_state_dict: a restore of the global RNG
        # after one was fetched comes too late for that batch (resume.ExactResume refuses it).
        self.batches_since_load = 0
        # Called at every iter(): ExactResume refuses an iterator made before its checkpoint is loaded.
        self.before_iter: Callable[[], None] | None = None
        # True: ExactResume sets snapshot_every_n_steps to its save interval (build_dataloader's default).
        self.snapshot_follows_saves = False

    def __iter__(self) -> Iterator[Any]:
        if self.before_iter is not None:
            self.before_iter()
        return CountingIterator(super().__iter__(), self)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (inside a pickled Trainer, say): the live iterator's position becomes the pending state, so
        the copy's first ``iter()`` resumes there; the iterator and its worker processes stay here (torch
        cannot pickle them)."""
        state = dict(self.__dict__, _iterator=None, _initial_iter_for_state_dict=False)
        if self._iterator is not None:
            state["next_iter_state"] = super().state_dict()
        return state

    def state_dict(self) -> dict[str, Any]:
        # Not iterated since construction or the last load: the state is the pending one (None: the start).
        # Asking torchdata would build an iterator, starting the workers only to throw them away (e.g. when
        # the checkpoint manager builds DCP's load template at resume).
        loader_state = self.next_iter_state if self._iterator is None else super().state_dict()
        state = {"num_workers": self.num_workers_configured, "loader": loader_state}
        return {dp_rank_key(self.dp_rank): encode_state(state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches_since_load = 0
        state = decode_state(state_dict[dp_rank_key(self.dp_rank)])
        if state.get("stream"):
            raise ConfigError("the checkpoint's data came from a streaming source (data.streaming) and this run "
                              "uses the map-style dataset: resume with --data.streaming, or start a new run")
        saved_workers = int(state["num_workers"])
        if state["loader"] is None:  # saved before its first batch: a fresh loader is that state
            return
        if saved_workers == self.num_workers_configured:
            super().load_state_dict(state["loader"])
            return
        if self.uses_global_rng:
            reason = (
                f"the checkpoint's dataloader ran {saved_workers} workers and this run has "
                f"{self.num_workers_configured}: the dataset may draw from global RNGs in __getitem__, whose "
                "streams depend on the worker count, so the resume cannot be exact"
            )
            if self.on_num_workers_change == "error":
                raise ConfigError(
                    f"{reason}; resume with num_workers={saved_workers}, derive the dataset's randomness from "
                    "sample keys (docs/data.md: making your dataset resume exactly), or pass "
                    'on_num_workers_change="warn" to continue inexactly'
                )
            if self.dp_rank == 0:
                print(f'WARNING: {reason}; continuing inexactly (on_num_workers_change="warn")',
                      file=sys.stderr, flush=True)
        # Another worker count: torchdata's state cannot be loaded, but the sampler position is all a
        # form-1 dataset needs (its samples are pure functions of their keys).
        sampler_state, batches_to_skip = _sampler_after_last_batch(state["loader"])
        self.batch_sampler.load_state_dict(sampler_state)
        for _ in range(batches_to_skip):
            next(self.batch_sampler)
        super().load_state_dict({})


def shutdown_workers(loader: StatefulDataLoader) -> None:
    """Shut down the worker processes of ``loader``'s live iterator, before the process group goes: an
    iterator left to the garbage collector may outlive it (e.g. when an exception holds a reference)."""
    iterator, loader._iterator = loader._iterator, None
    shutdown = getattr(iterator, "_shutdown_workers", None)  # only a multi-process iterator has workers
    if shutdown is not None:
        shutdown()


class CountingIterator:
    """The loader's own iterator, counting the batches it yields into ``loader.batches_since_load``."""

    def __init__(self, inner: Iterator[Any], loader: ResumableDataLoader) -> None:
        self.inner = inner
        self.loader = loader

    def __iter__(self) -> CountingIterator:
        return self

    def __next__(self) -> Any:
        batch = next(self.inner)
        self.loader.batches_since_load += 1
        return batch
