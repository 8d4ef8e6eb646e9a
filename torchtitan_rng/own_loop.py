"""Exact resume for a training loop you wrote yourself (a plain DDP loop, a torchrun tutorial script).

Three additions to an existing loop::

    loader = build_dataloader(dataset, batch_size=8, seed=SEED)          # instead of DataLoader(...)
    exact = ExactResume(folder, model=model, optimizer=opt, dataloader=loader, interval=100, seed=SEED)
    with exact:                           # close(): the loader's workers end, saves are finished
        start = exact.load()              # newest complete checkpoint in ``folder``; 0 when there is none
        batches = iter(loader)
        exact.restore_rng()               # the step boundary: after start-up, before the first batch
        for step in range(start + 1, last_step + 1):
            ...                           # fetch, forward, backward, optimizer step
            exact.maybe_save(step, last_step=last_step)
            if exact.should_stop(step):   # a stop signal (stop_signals=...): saved at this step on every rank
                break

With ``tensor_fingerprint=True`` one more call, after the step's backward and before gradient clipping and the
optimizer step, hashes what the step consumed and computed (``exact.fingerprint(batch, loss)``); ``maybe_save``
then hashes the update, and ``python -m torchtitan_rng.compare_losses A B`` names the first tensor that differs
between two runs (docs/diagnosis.md).

The pieces it bundles (TrainState, CheckpointManager, ResumableDataLoader) stay usable on their own.
"""

from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset

from torchtitan_rng.checkpoint import integrity, run_record
from torchtitan_rng.checkpoint.layout import start_location
from torchtitan_rng.checkpoint.storage import Location
from torchtitan_rng.checkpoint.manager import CheckpointManager
from torchtitan_rng.checkpoint.states import Stateful, checkpoint_parts
from torchtitan_rng.checkpoint.train_state import TrainState
from torchtitan_rng.checkpoint.storage import is_url
from torchtitan_rng.checkpoint.vetting import vet
from torchtitan_rng.config import Debug
from torchtitan_rng.data.dataloader import ResumableDataLoader, require_map_style, shutdown_workers
from torchtitan_rng.data.sample_rng import SampleRandomDataset
from torchtitan_rng.data.worker_rng import with_worker_rng
from torchtitan_rng.diagnosis.tensor_fingerprints import TensorFingerprints, build_tensor_fingerprints
from torchtitan_rng.distributed import StopVote, rank_and_world_size
from torchtitan_rng.errors import CheckpointError, TorchtitanRngError
from torchtitan_rng.parallel.numerics import CarriedNumerics
from torchtitan_rng import signals
from torchtitan_rng.rng import seed_training_streams


class RestoreOrderError(TorchtitanRngError, RuntimeError):
    """The resume order ``load()``, ``iter(dataloader)``, ``restore_rng()`` was broken: ``iter(dataloader)``
    before ``load()``, ``restore_rng()`` before ``load()`` or after randomness of the resumed step was consumed,
    or ``load()`` again after ``iter(dataloader)`` or ``restore_rng()``; one line says which."""


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
                     persistent_workers: bool = False, snapshot_every_n_steps: int | None = None
                     ) -> ResumableDataLoader:
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
        snapshot_every_n_steps: batches between two snapshots of the loader's position (with workers, a
            snapshot carries each worker's streams). None: :class:`ExactResume` sets its save ``interval``
            (1 without it). A save between two snapshots is exact too: the resume redoes the batches since.

    The loader yields forever: stop after your last step, not at the end of an epoch. An IterableDataset
    is refused with a TypeError: resuming needs the indices of a map-style dataset.
    """
    require_map_style(dataset)
    if sample_keys is None:
        sample_keys = isinstance(dataset, SampleRandomDataset)
    rank, world = rank_and_world_size()
    loader = ResumableDataLoader(
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
        snapshot_every_n_steps=snapshot_every_n_steps or 1,
    )
    # Snapshots cost each worker a capture of its streams: by default, only as often as ExactResume saves.
    loader.snapshot_follows_saves = snapshot_every_n_steps is None
    return loader


class _OwnLoopOptIn(run_record.OptIn):
    """``load(allow_changes=[...])``: an entry names a key, a section ("optimizer", "model", "config") or a
    key's last part ("lr" allows the lr of every param group)."""

    def __init__(self) -> None:
        super().__init__(name="allow_changes", how='allow_changes=["{key}"]')

    def allows(self, key: str, allowed: Sequence[str]) -> bool:
        return any(key == entry or key.startswith(f"{entry}.") or key.endswith(f".{entry}") for entry in allowed)


def _json_value(value: Any) -> Any:
    """``value`` when JSON holds it as it is (numbers, strings, lists of them); else its repr."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def _record_values(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                   dataloader: ResumableDataLoader | None, world_size: int,
                   config: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a loop was built with, as ``section.key``: a resume with another value is not the same run."""
    values: dict[str, Any] = {"processes": world_size}
    values.update({f"model.{name}": list(param.shape) for name, param in model.named_parameters()})
    if optimizer is not None:
        values["optimizer.type"] = type(optimizer).__name__
        for index, group in enumerate(optimizer.param_groups):
            values[f"optimizer.group{index}.params"] = len(group["params"])
            values.update({f"optimizer.group{index}.{key}": _json_value(value) for key, value in group.items()
                           if key != "params"})
    if dataloader is not None:
        sampler = dataloader.batch_sampler
        values.update({"dataloader.batch_size": sampler.batch_size,
                       "dataloader.num_workers": dataloader.num_workers_configured,
                       "dataloader.seed": getattr(sampler, "seed", None),
                       "dataloader.shuffle": getattr(sampler, "shuffle", None),
                       "dataloader.samples": getattr(sampler, "num_samples", None)})
    values.update({f"config.{key}": _json_value(value) for key, value in (config or {}).items()})
    return values


def _shut_down_at_exit(dataloader: weakref.ref[ResumableDataLoader] | None) -> None:
    """At close(), or at exit before interpreter teardown: the loader's workers end while the process group
    and DDP's reducer are still whole; left to teardown, their order is arbitrary and can hang the exit."""
    loader = dataloader() if dataloader is not None else None
    if loader is not None:
        shutdown_workers(loader)


def _weakly(method: Callable[[], None]) -> Callable[[], None]:
    """``method`` called through a weak reference. The loader holds it: a strong one would make the loader and
    this object a cycle, left to the cyclic collector, which closes the worker queues' feeder threads before
    the iterator's shutdown sends its stop messages through them (each worker then waits out a 5 s timeout)."""
    weak = weakref.WeakMethod(method)

    def call() -> None:
        bound = weak()
        if bound is not None:
            bound()

    return call


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
        config: your own settings that shape the run (e.g. ``{"warmup": 100, "data": "v2"}``; JSON values),
            recorded with every checkpoint and compared at :meth:`load` like the rest of the record.
        stop_signals: signals (e.g. ``("SIGTERM", "SIGUSR1", "SIGINT")``) that only set a flag from now on;
            the loader's workers ignore them. :meth:`should_stop` turns the flag into a save at an agreed step.
            With ``"SIGINT"`` listed, the first Ctrl-C stops so, and a second one ends the process at once.
        signing_key_env: the NAME of an environment variable holding a secret key (as the trainer's
            ``checkpoint.signing_key_env``): each checkpoint's checksums are signed with it (HMAC-SHA256) and
            :meth:`load` refuses one whose signature does not match, naming the file. "" (default): unsigned.
            A named variable that is unset or empty raises :class:`CheckpointError` here.
        tensor_fingerprint: hash, per step and rank, each batch, loss and gradient (:meth:`fingerprint`), each
            parameter after the update (:meth:`maybe_save`; the optimizer state too where it saves) and what a
            resume loaded, into ``dump_folder/tensor_fingerprints/``: ``compare_losses`` then names the first
            tensor that differs.
        fingerprint_modules_at_step: with ``tensor_fingerprint``, at this step also hash every module call's
            inputs and outputs (forward hooks, that step only); 0: none.
        fingerprint_optimizer_every_step: with ``tensor_fingerprint``, hash the optimizer state after every
            step's update, not only where it saves and starts (with AdamW, twice the bytes a step hashes).
        dump_folder: where the fingerprints go, beside your loss log (``compare_losses`` reads both from it);
            default: the folder holding ``folder`` (a URL ``folder`` needs it given).

    Every checkpoint records what the loop was built with: parameter names and shapes, the optimizer's
    type and hyperparameters per param group, the loader's batch size, seed, shuffle, sample count and
    workers, the process count and ``config``. :meth:`load` refuses a resume that changed any of them,
    except the loader's workers (the loader has its own policy, ``on_num_workers_change``).

    Use it as a context manager (or call :meth:`close`): the loader's workers end and saves are finished
    before the process group goes. Without either, the workers end when this object is dropped, or at
    interpreter exit.
    """

    def __init__(self, folder: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 dataloader: ResumableDataLoader | None = None, lr_scheduler: Stateful | None = None,
                 extra: Mapping[str, Stateful] | None = None, interval: int, keep_latest_k: int = 0,
                 seed: int | None = None, device: torch.device | None = None,
                 config: Mapping[str, Any] | None = None, stop_signals: Sequence[str] = (),
                 signing_key_env: str = "", tensor_fingerprint: bool = False, fingerprint_modules_at_step: int = 0,
                 fingerprint_optimizer_every_step: bool = False, dump_folder: str | Path | None = None) -> None:
        if interval < 1:
            raise ValueError(f"interval = {interval}: it must be >= 1")
        if fingerprint_modules_at_step < 0:
            raise ValueError(f"fingerprint_modules_at_step = {fingerprint_modules_at_step}: it must be >= 0")
        if tensor_fingerprint and dump_folder is None and is_url(str(folder)):
            raise ValueError(f"tensor_fingerprint with folder {folder}: give dump_folder, a local folder for the "
                             "fingerprints")
        # Before anything is built: a key named but not set must not mean unsigned saves.
        self.signing = integrity.signing_key(signing_key_env)
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
        self.manager = CheckpointManager(folder, parts, interval=interval, keep_latest_k=keep_latest_k,
                                         rank=self.rank, signing=self.signing)
        self.optimizer = optimizer
        # As built (the record holds them as JSON): allow_changes puts these back over the loaded ones.
        self._built_hyperparameters = [{key: value for key, value in group.items() if key != "params"}
                                       for group in (optimizer.param_groups if optimizer is not None else [])]
        # A collective (it makes a process group): every rank builds ExactResume with the same stop_signals.
        self._stop_vote = StopVote() if stop_signals else None
        self.record = run_record.make_record(_record_values(model, optimizer, dataloader, self.world_size, config),
                                             None)
        self.manager.run_record = self.record
        self.prints: TensorFingerprints | None = build_tensor_fingerprints(
            Debug(tensor_fingerprint=tensor_fingerprint, fingerprint_modules_at_step=fingerprint_modules_at_step,
                  fingerprint_optimizer_every_step=fingerprint_optimizer_every_step),
            model, optimizer, rank=self.rank, world_size=self.world_size,
            dump_folder=Path(dump_folder) if dump_folder is not None else Path(folder).parent,
            config=self.record["config"])
        self.loaded_from: Path | Location | None = None
        self._load_called = False
        self._step_at_load = 0
        # The order's later calls, so that a load() after them is refused: it would reset the position the
        # order check reads while the live iterator keeps its own, and the streams already put back.
        self._iterated = False
        self._restored = False
        if dataloader is not None:
            dataloader.before_iter = _weakly(self._refuse_iter_before_load)
            if dataloader.snapshot_follows_saves:  # no iterator yet (before_iter refuses one): it takes this
                dataloader.snapshot_every_n_steps = interval
        if stop_signals:
            # Before iter(dataloader) forks the workers: they learn which signals to ignore.
            signals.install(tuple(stop_signals))
        # The loader weakly: the finalizer alone must not keep it, and its workers, alive.
        self._at_exit = weakref.finalize(self, _shut_down_at_exit,
                                         weakref.ref(dataloader) if dataloader is not None else None)

    def __enter__(self) -> ExactResume:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close(failed=error is not None)

    def close(self, *, failed: bool = False) -> None:
        """End the run's resources: the loader's worker processes, and a save still being written (with
        ``failed``, left unfinished as ``step-N.partial``, which is never loaded). Call it on every rank
        before destroying the process group; a second call does nothing."""
        try:
            if self._stop_vote is not None and not failed:
                self._stop_vote.close()  # every rank has one vote in flight
            self.manager.close(abandon=failed)
            if self.prints is not None:
                self.prints.close()  # what is queued is written
                self.prints = None
        finally:
            self._at_exit()  # the workers, once

    @property
    def step(self) -> int:
        """The last finished step: the loaded one after :meth:`load`, then what :meth:`maybe_save` was given."""
        return self.train_state.step

    def load(self, *, load_step: int = -1, initial_load_path: str | Path = "",
             exclude: Sequence[str] = (), allow_changes: Sequence[str] = ()) -> int:
        """Load the newest complete checkpoint in ``folder`` (or ``load_step``; or, when ``folder`` has
        none, one from ``initial_load_path``) and return its step; 0 when there is nothing to load.

        The random streams are only remembered here; :meth:`restore_rng` puts them back. Raises
        :class:`CheckpointError` (one line per reason, on every rank) when it is not signed with the key of
        ``signing_key_env`` (checked before anything else is read), when the checkpoint's files changed
        since the save, when it was saved by another number of processes (it cannot resume exactly), when
        the loop was built with other values than the checkpoint recorded (each key with the saved and the
        new value), or when it lacks a part this run needs; ``exclude`` names parts to leave as they are
        instead. ``allow_changes`` names recorded keys that may differ (a key, a section such as
        ``"optimizer"``, or a last part such as ``"lr"``): a WARNING each on stderr, and the optimizer
        hyperparameters you built with replace the saved ones.
        """
        self._refuse_load_after_start()
        self._load_called = True
        path = start_location(self.manager.folder, load_step, initial_load_path)
        if path is None:
            return 0
        try:
            vetted = vet(path, layout=lambda info: CarriedNumerics.check_checkpoint(info, self.world_size, None),
                         record=self.record, allowed=allow_changes, opt_in=_OwnLoopOptIn(),
                         device=self.train_state.device, signing=self.signing)
        except run_record.ConfigDriftError as err:
            raise CheckpointError(str(err)) from None
        for line in vetted.warnings if self.rank == 0 else ():
            print(line, file=sys.stderr, flush=True)
        result = self.manager.load(vetted.info, exclude=exclude)
        self._apply_allowed_changes(path)
        if result.missing:
            raise CheckpointError(
                f"checkpoint {path} holds no {', '.join(result.missing)} for this run (saved without that "
                "part); pass exclude=[...] to start those parts fresh"
            )
        self.loaded_from = path.native
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
        if not self._load_called:
            raise RestoreOrderError(
                "restore_rng() was called before ExactResume.load(): the streams it puts back are the checkpoint's, "
                "which load() reads; call load(), then iter(dataloader), then restore_rng()"
            )
        self._restored = True
        if self.prints is not None:  # the state entering the first step: what load() put back
            self.prints.step_begin(self.train_state.step + 1)
        if self.train_state.restore_rng():
            return True
        if self.seed is not None:
            seed_training_streams(self.seed, self.rank)
        return False

    def fingerprint(self, batch: Any, loss: torch.Tensor | None = None) -> None:
        """With ``tensor_fingerprint``: hash one micro-batch (a dict, tuple or list of tensors, or a tensor: one
        hash per sample), its loss as this rank computed it (before any reduction), and the gradients. Call it
        after each micro-batch's backward; the step's last call must come before gradient clipping and the
        optimizer step (the gradients it hashes are the step's). Module calls (``fingerprint_modules_at_step``)
        are hashed up to the step's first call. Without ``tensor_fingerprint`` it does nothing."""
        if self.prints is None:
            return
        self.prints.batch(batch)
        if loss is not None:
            self.prints.loss(loss)
        self.prints.gradients()

    def _apply_allowed_changes(self, checkpoint: Location) -> None:
        """The optimizer hyperparameters that ``allow_changes`` let differ: the values built with, not the
        checkpoint's (which loading the optimizer's state put back)."""
        saved = run_record.read_record(checkpoint)
        if saved is None or self.optimizer is None:
            return
        for change in run_record.differences(saved, self.record):
            section, _, rest = change.key.partition(".")
            group, _, name = rest.partition(".")
            if section == "optimizer" and group.startswith("group") and name not in ("params", ""):
                index = int(group[len("group"):])
                self.optimizer.param_groups[index][name] = self._built_hyperparameters[index][name]

    def _refuse_iter_before_load(self) -> None:
        if not self._load_called:
            raise RestoreOrderError(
                "iter(dataloader) was called before ExactResume.load(): the loader would start from the "
                "beginning instead of the checkpoint's position; call load() first"
            )
        self._iterated = True

    def _refuse_load_after_start(self) -> None:
        """``load()`` once, before the run starts: after ``iter(dataloader)`` the live iterator would keep its
        position while the checkpoint's is loaded beside it; after ``restore_rng()`` the streams put back would
        be another checkpoint's (or the fresh run's)."""
        later = ("iter(dataloader)" if self._iterated else "restore_rng()" if self._restored else "")
        if later:
            raise RestoreOrderError(
                f"ExactResume.load() was called after {later}: the run already started from what was there; "
                "call load() once, before iter(dataloader) and restore_rng() (to load another checkpoint, build "
                "a new ExactResume and dataloader)"
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

    def maybe_save(self, step: int, *, last_step: int) -> Path | Location | None:
        """Record that ``step`` finished; save when it is a multiple of ``interval`` or ``last_step``.

        Call it on every rank at the end of every step (saving is a collective). Returns the checkpoint
        folder when one was written.
        """
        self.train_state.step = step
        saved = self.manager.save(step, last_step=last_step)
        if self.prints is not None and self.prints.record.get("step") == step:  # the update, after the step
            self.prints.updated(flush=False)
            if saved is not None:
                self.prints.saving(step)  # the optimizer state, where a checkpoint holds it
            elif step >= last_step:
                self.prints.flush()
            if step < last_step:
                self.prints.step_begin(step + 1)
        return saved

    def save(self, step: int) -> Path | Location:
        """Save now, as the checkpoint of finished step ``step`` (e.g. on a stop signal); a collective."""
        self.train_state.step = step
        path = self.manager.save(step, force=True)
        assert path is not None  # a forced save always writes (or already wrote) this step
        if self.prints is not None:
            self.prints.saving(step)
        return path

    def should_stop(self, step: int) -> bool:
        """Whether to leave the loop after ``step``: True on every rank when any rank got one of
        ``stop_signals``, and then ``step`` has been saved (a collective: call it on every rank after
        :meth:`maybe_save`, every step). With several processes the vote reads nothing from the device and
        waits for no rank: the step it stops at is the one after the signal's. Without ``stop_signals`` it is
        always False and costs nothing."""
        if self._stop_vote is None:
            return False
        if not self._stop_vote.poll(signals.received() is not None):
            return False
        self.save(step)
        return True
