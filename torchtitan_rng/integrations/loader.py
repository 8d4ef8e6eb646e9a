"""The training dataloader both integrations hand to their framework.

A framework iterates its train loader once per epoch and may look ahead or rebuild the loader to skip
batches on resume. :class:`EpochLoader` instead keeps one endless :class:`ResumableDataLoader` iterator
for the whole run and shows it to the framework as epochs of ``len(self)`` batches, so:

* its position is the batches the training loop took (no lookahead: the frameworks do not prefetch
  from a loader whose length they know), saved per rank with this rank's global random streams;
* after :meth:`load_state_dict` the streams are put back inside the first ``next()``, i.e. right before
  the first batch of the resumed run is fetched, after everything the framework does at start-up;
* the sampler's epochs run on without a gap (a batch may straddle two epochs when the per-rank sample
  count is not a multiple of the batch size), so they are not the framework's epochs exactly.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch.utils.data import Dataset

from torchtitan_rng import device as device_lib
from torchtitan_rng.data.dataloader import ResumableDataLoader, shutdown_workers
from torchtitan_rng.distributed import rank_and_world_size
from torchtitan_rng.own_loop import build_dataloader
from torchtitan_rng.rng import capture_global_rng, restore_global_rng


class EpochLoader:
    """An endless resumable loader, iterated through one persistent iterator, seen as epochs."""

    def __init__(self, loader: ResumableDataLoader, batches_per_epoch: int, device: torch.device) -> None:
        if batches_per_epoch < 1:
            raise ValueError(f"the dataset gives this rank fewer samples than one batch of {loader.batch_sampler.batch_size}")
        self.loader = loader
        self.batches_per_epoch = batches_per_epoch
        self.device = device
        self._iterator: Any = None
        self._pending_rng: dict[str, Any] | None = None

    @property
    def dataset(self) -> Dataset:
        return self.loader.dataset

    def __len__(self) -> int:
        return self.batches_per_epoch

    def __iter__(self) -> EpochLoader:
        return self

    def __next__(self) -> Any:
        # One iterator per run, made at the first batch (frameworks call iter() early, e.g. to check the
        # loader): the workers keep their streams across epochs.
        if self._iterator is None:
            self._iterator = iter(self.loader)
        if self._pending_rng is not None:  # the step boundary: nothing of the resumed step has drawn yet
            restore_global_rng(self._pending_rng, self.device)
            self._pending_rng = None
        return next(self._iterator)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled: the loader pickles its live position (see ``ResumableDataLoader.__getstate__``), so the copy
        makes its own iterator at its first batch."""
        return dict(self.__dict__, _iterator=None)

    def state_dict(self) -> dict[str, Any]:
        """This rank's loader position and global streams, as they are between two training steps."""
        rank, world = rank_and_world_size()
        return {"rank": rank, "world_size": world, "loader": self.loader.state_dict(),
                "rng": capture_global_rng(self.device)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rank, world = rank_and_world_size()
        if int(state["world_size"]) != world or int(state["rank"]) != rank:
            raise ValueError(
                f"the checkpoint's loader state is rank {state['rank']} of {state['world_size']} processes and this is "
                f"rank {rank} of {world}: resume with {state['world_size']} processes for an exact resume"
            )
        if self._iterator is not None:
            raise RuntimeError("EpochLoader.load_state_dict must come before the loader is iterated")
        self.loader.load_state_dict(state["loader"])
        self._pending_rng = state["rng"]

    def skip(self, batches: int) -> None:
        """Start ``batches`` batches later, without fetching them (resuming a checkpoint that has no loader state,
        inexactly: the sampler's position only)."""
        if self._iterator is not None:
            raise RuntimeError("EpochLoader.skip must come before the loader is iterated")
        for _ in range(batches):
            next(self.loader.batch_sampler)

    def close(self) -> None:
        """Stop the worker processes now. The loader keeps its live iterator (for ``state_dict``), so dropping
        ours does not end them, and exit-time termination cannot: they ignore the checkpoint signals. Its
        position stays: a checkpoint saved after training (e.g. ``trainer.save_checkpoint`` after ``fit()``)
        resumes where training stopped, and iterating again continues from there."""
        self._iterator = None
        position = self.loader.state_dict() if self.loader._iterator is not None else None
        shutdown_workers(self.loader)
        if position is not None:
            self.loader.load_state_dict(position)  # pending: what state_dict() returns, where iteration resumes


def exact_resume_loader(dataset: Dataset, *, batch_size: int, seed: int, num_workers: int = 0,
                        collate_fn: Callable[[list[Any]], Any] | None = None, shuffle: bool = True,
                        prefetch_factor: int = 2, device: torch.device | None = None,
                        on_num_workers_change: str = "error") -> EpochLoader:
    """The train loader for a framework: this rank's share of ``dataset`` in batches of ``batch_size``,
    a permutation per epoch derived from ``seed``, workers whose global streams are saved with it.

    ``device``: the device whose generator is saved with the CPU streams; default: this process's
    (``LOCAL_RANK``) accelerator, or the CPU. ``on_num_workers_change``: ``"error"`` refuses to resume a
    checkpoint saved with another ``num_workers`` (when the dataset may draw from the global streams),
    ``"warn"`` continues inexactly with one WARNING.
    """
    rank, world = rank_and_world_size()
    loader = build_dataloader(dataset, batch_size=batch_size, seed=seed, num_workers=num_workers, shuffle=shuffle,
                              prefetch_factor=prefetch_factor, collate_fn=collate_fn, dp_rank=rank, dp_world=world,
                              on_num_workers_change=on_num_workers_change)
    if device is None:
        device = device_lib.device_for_rank(int(os.environ.get("LOCAL_RANK", "0")))
    return EpochLoader(loader, (len(dataset) // world) // batch_size, device)  # type: ignore[arg-type]
