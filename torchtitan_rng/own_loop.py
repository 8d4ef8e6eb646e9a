"""Exact resume for a training loop you wrote yourself (a plain DDP loop, a torchrun tutorial script).

Three additions to an existing loop::

    loader = build_dataloader(dataset, batch_size=8, seed=SEED)          # instead of DataLoader(...)
    exact = ExactResume(folder, model=model, optimizer=opt, dataloader=loader, interval=100, seed=SEED)
    start = exact.load()                  # newest complete checkpoint in ``folder``; 0 when there is none
    batches = iter(loader)
    exact.restore_rng()                   # the step boundary: after start-up, before the first batch
    for step in range(start + 1, last_step + 1):
        ...                               # fetch, forward, backward, optimizer step
        exact.maybe_save(step, last_step=last_step)

The pieces it bundles (TrainState, CheckpointManager, ResumableDataLoader) stay usable on their own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset

from torchtitan_rng.checkpoint.layout import CheckpointError, resolve_checkpoint
from torchtitan_rng.checkpoint.manager import CheckpointManager
from torchtitan_rng.checkpoint.resume import load_checkpoint
from torchtitan_rng.checkpoint.states import Stateful, checkpoint_parts
from torchtitan_rng.checkpoint.train_state import TrainState
from torchtitan_rng.data.dataloader import ResumableDataLoader, require_map_style
from torchtitan_rng.data.sample_rng import SampleRandomDataset
from torchtitan_rng.data.worker_rng import with_worker_rng
from torchtitan_rng.distributed import rank_and_world_size
from torchtitan_rng.rng import seed_training_streams


class RestoreOrderError(RuntimeError):
    """A step of the resume order was skipped: ``iter(dataloader)`` before ``load()``, or ``restore_rng()``
    after randomness of the resumed step was consumed; one line says which."""


class _PlainIndices(Dataset):
    """Hands a dataset that knows nothing of sample keys the index ``key % len`` it expects.

    ``state_dict``/``load_state_dict`` of the wrapped dataset stay visible, so StatefulDataLoader still
    saves a Stateful dataset's state (it checks for those two methods).
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.num_samples = len(dataset)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, key: int) -> Any:
        return self.dataset[int(key) % self.num_samples]

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (e.g. while unpickling in a worker): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)


def build_dataloader(dataset: Dataset, *, batch_size: int, seed: int, num_workers: int = 0,
                     shuffle: bool = True, sample_keys: bool | None = None, prefetch_factor: int = 2,
                     capture_worker_rng: bool = True, on_num_workers_change: str = "error",
                     dp_rank: int | None = None, dp_world: int | None = None,
                     collate_fn: Callable[[list[Any]], Any] | None = None, pin_memory: bool = False,
                     drop_last: bool = True, timeout: float = 0,
                     worker_init_fn: Callable[[int], None] | None = None, multiprocessing_context: Any = None,
                     persistent_workers: bool = False) -> ResumableDataLoader:
    """A StatefulDataLoader that resumes exactly: its own seeded generator, a per-rank stateful sampler
    that runs over epochs forever (no ``set_epoch``), and its state under a per-rank checkpoint key.

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``).
        batch_size: samples per batch on this rank.
        seed: the run's seed; the epoch permutations and the loader's generator derive from it.
        num_workers: worker processes, as for ``DataLoader``.
        shuffle: a new permutation every epoch (the same on every rank; each rank takes its share).
        sample_keys: True: ``dataset[key]`` gets the sample key ``epoch * len(dataset) + index``, as a
            :class:`SampleRandomDataset` needs (per-sample randomness seeded from the whole key differs
            between epochs and is the same after a resume). False: it gets an index in ``range(len)``, as
            from a DataLoader. Default: True for a SampleRandomDataset, else False.
        prefetch_factor: batches each worker prepares ahead (only with workers).
        capture_worker_rng: a dataset that may draw from the global RNGs (anything but a
            SampleRandomDataset) gets each worker's streams saved and restored with the loader's state.
        on_num_workers_change: "error" (a ConfigError on loading such a dataset's checkpoint with another
            ``num_workers``) or "warn" (continue inexactly).
        dp_rank, dp_world: this rank and the number of data-parallel ranks; by default the rank and world
            size of the initialised process group (0 and 1 without one).
        collate_fn, pin_memory, timeout, multiprocessing_context, persistent_workers: as for ``DataLoader``.
        drop_last: True, the only choice: every batch is full, because the sampler runs over epochs without
            end and a batch may span two epochs, so there is never a partial last batch to drop or keep.
        worker_init_fn: yours runs in each worker after ours (which makes the worker ignore the signals its
            rank checkpoints on).

    The loader yields forever: stop after your last step, not at the end of an epoch. An IterableDataset
    is refused with a TypeError: resuming needs the indices of a map-style dataset.
    """
    require_map_style(dataset)
    if sample_keys is None:
        sample_keys = isinstance(dataset, SampleRandomDataset)
    rank, world = rank_and_world_size()
    return ResumableDataLoader(
        with_worker_rng(dataset if sample_keys else _PlainIndices(dataset), capture_worker_rng),
        batch_size=batch_size,
        dp_rank=rank if dp_rank is None else dp_rank,
        dp_world=world if dp_world is None else dp_world,
        seed=seed,
        num_workers=num_workers,
        prefetch_factor=prefetch_factor,
        shuffle=shuffle,
        on_num_workers_change=on_num_workers_change,
        collate_fn=collate_fn,
        pin_memory=pin_memory,
        drop_last=drop_last,
        timeout=timeout,
        worker_init_fn=worker_init_fn,
        multiprocessing_context=multiprocessing_context,
        persistent_workers=persistent_workers,
    )


def _model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


class ExactResume:
    """Checkpoints a loop's model, optimizer, dataloader position, lr schedule and random streams.

    Saves go to ``folder/step-N`` with torch.distributed.checkpoint (a collective: every rank calls
    :meth:`maybe_save` / :meth:`save`); per-rank values (this rank's RNG streams and data position) are
    stored under rank-unique keys, so each rank gets its own back.

    Args:
        folder: where the ``step-N`` checkpoints go (shared by all ranks).
        model: the model (plain, ``DistributedDataParallel`` or FSDP2-sharded).
        optimizer: its optimizer, if any.
        dataloader: a loader from :func:`build_dataloader` (a plain DataLoader cannot resume its position).
        lr_scheduler: any object with ``state_dict``/``load_state_dict``, e.g. a torch lr scheduler.
        extra: more Stateful objects by name; per-rank state in them needs rank-unique keys.
        interval: :meth:`maybe_save` saves every ``interval`` steps and at the last step.
        keep_latest_k: keep only the newest k checkpoints (0: all).
        seed: on a run that starts fresh, :meth:`restore_rng` seeds this rank's global streams from
            ``(seed, rank)``; None leaves them as they are.
        device: the device whose generator is captured along with the CPU ones; default: the model's.
    """

    def __init__(self, folder: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 dataloader: ResumableDataLoader | None = None, lr_scheduler: Stateful | None = None,
                 extra: Mapping[str, Stateful] | None = None, interval: int, keep_latest_k: int = 0,
                 seed: int | None = None, device: torch.device | None = None) -> None:
        if interval < 1:
            raise ValueError(f"interval = {interval}: it must be >= 1")
        if dataloader is not None and not isinstance(dataloader, ResumableDataLoader):
            raise TypeError(
                f"dataloader is a {type(dataloader).__name__}; build it with torchtitan_rng.build_dataloader "
                "so that its position and generator are saved per rank"
            )
        self.rank, self.world_size = rank_and_world_size()
        self.seed = seed
        self.dataloader = dataloader
        self.train_state = TrainState(device or _model_device(model), self.rank, self.world_size)
        parts = checkpoint_parts(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, dataloader=dataloader,
                                 train_state=self.train_state, extras=extra)
        self.manager = CheckpointManager(Path(folder), parts, interval=interval, keep_latest_k=keep_latest_k,
                                         rank=self.rank)
        self.loaded_from: Path | None = None
        self._load_called = False
        self._step_at_load = 0
        if dataloader is not None:
            dataloader.before_iter = self._refuse_iter_before_load

    @property
    def step(self) -> int:
        """The last finished step: the loaded one after :meth:`load`, then what :meth:`maybe_save` was given."""
        return self.train_state.step

    def load(self, *, load_step: int = -1, initial_load_path: str | Path = "",
             exclude: Sequence[str] = ()) -> int:
        """Load the newest complete checkpoint in ``folder`` (or ``load_step``; or, when ``folder`` has
        none, one from ``initial_load_path``) and return its step; 0 when there is nothing to load.

        The random streams are only remembered here; :meth:`restore_rng` puts them back. Raises
        :class:`CheckpointError` when the checkpoint was saved by another number of processes (it cannot
        resume exactly) or lacks a part this run needs; ``exclude`` names parts to leave as they are instead.
        """
        self._load_called = True
        path = resolve_checkpoint(self.manager.folder, load_step, initial_load_path)
        if path is None:
            return 0
        loaded = load_checkpoint(self.manager, path, world_size=self.world_size, exclude=exclude)
        if loaded.result.missing:
            raise CheckpointError(
                f"checkpoint {path} holds no {', '.join(loaded.result.missing)} for this run (saved without that "
                "part); pass exclude=[...] to start those parts fresh"
            )
        self.loaded_from = path
        self._step_at_load = self.train_state.step
        return self.train_state.step

    def restore_rng(self) -> bool:
        """Put this rank's global random streams back as they were when the checkpoint was taken.

        Call it once, at the step boundary: after building the model, ``load()``, ``iter(dataloader)`` and
        anything else that runs once at start-up, and before the first batch of the first step is fetched.
        On a fresh run it seeds the streams from ``(seed, rank)`` instead (when a seed was given), so a
        fresh run does not depend on what start-up consumed either. Returns True when streams were restored.

        Raises :class:`RestoreOrderError` when the dataloader has already handed out a batch, or a step
        was already recorded, since the checkpoint was loaded (or the loader built): the randomness of
        that step came from the wrong streams. Randomness drawn outside the dataloader and before the
        first step cannot be detected here.
        """
        self._check_nothing_consumed()
        if self.train_state.restore_rng():
            return True
        if self.seed is not None:
            seed_training_streams(self.seed, self.rank)
        return False

    def _refuse_iter_before_load(self) -> None:
        if not self._load_called:
            raise RestoreOrderError(
                "iter(dataloader) was called before ExactResume.load(): the loader would start from the "
                "beginning instead of the checkpoint's position; call load() first"
            )

    def _check_nothing_consumed(self) -> None:
        fetched = self.dataloader.batches_since_load if self.dataloader is not None else 0
        if fetched:
            raise RestoreOrderError(
                f"restore_rng() was called after the dataloader yielded {fetched} batch(es) of this run; "
                "call it after iter(dataloader) and before the first batch is fetched"
            )
        if self.train_state.step != self._step_at_load:
            raise RestoreOrderError(
                f"restore_rng() was called after step {self.train_state.step} ran; call it once, before the "
                "first step"
            )

    def maybe_save(self, step: int, *, last_step: int) -> Path | None:
        """Record that ``step`` finished; save when it is a multiple of ``interval`` or ``last_step``.

        Call it on every rank at the end of every step (saving is a collective). Returns the checkpoint
        folder when one was written.
        """
        self.train_state.step = step
        return self.manager.save(step, last_step=last_step)

    def save(self, step: int) -> Path:
        """Save now, as the checkpoint of finished step ``step`` (e.g. on a stop signal); a collective."""
        self.train_state.step = step
        path = self.manager.save(step, force=True)
        assert path is not None  # a forced save always writes (or already wrote) this step
        return path
