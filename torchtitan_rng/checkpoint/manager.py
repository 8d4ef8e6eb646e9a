"""Saves and loads a run's named parts with torch.distributed.checkpoint, and owns the save policy.

``save(step, last_step=...)`` is called at every step boundary and decides: nothing when checkpointing is
off or the step is not a multiple of ``interval``; a blocking save at the last step; otherwise, with
``async_mode = "async"``, a background save (a host copy of every part is staged at the step boundary —
the RNG, dataloader and train state of that boundary — and DCP writes it in a background thread). It also
finishes a background save whose write is done. ``save(step, force=True)`` saves now whatever the policy
(a stop signal). The folder layout and crash-safety rules are in layout.py: a save is written to
``step-N.partial`` and renamed once every rank has finished (for a background save: once its write has
finished everywhere), so a ``step-N`` folder is always complete; on an object store (storage.py) it is
written to ``step-N`` and counts once its completion marker, written last, is there.

Errors name this class's parameters; test hooks (fault injection) are handed in, never imported here.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.planner import SavePlanner

from torchtitan_rng.checkpoint import dcp_io, integrity, layout, owner, run_record
from torchtitan_rng.errors import CheckpointError, disk_full, first_line
from torchtitan_rng.checkpoint.dcp_io import inspect_checkpoint
from torchtitan_rng.checkpoint.layout import CheckpointInfo
from torchtitan_rng.checkpoint.safe_load import SafeLoadPlanner
from torchtitan_rng.checkpoint.staging import HostCopyStager
from torchtitan_rng.checkpoint.states import Stateful
from torchtitan_rng.checkpoint.storage import Location, Where, folder_location
from torchtitan_rng.distributed import barrier


class SaveHooks(Protocol):
    """Called at named moments of a save (tests use them to kill a rank exactly there)."""

    def at(self, point: str, step: int) -> None: ...

    def save_planner(self, step: int) -> SavePlanner | None: ...


def _first_failure(err: CheckpointException) -> BaseException:
    """The original exception inside DCP's wrapper (one per failed rank)."""
    return next(iter(err.failures.values()))[0]


def _save_failure(step: int, folder: Location, err: BaseException) -> CheckpointError:
    """One line for a failed save: "the disk is full" when it is, else the original error's first line."""
    cause = _first_failure(err) if isinstance(err, CheckpointException) else err
    if disk_full(cause):
        return CheckpointError(f"saving step {step} into {folder} failed: the disk is full; the complete "
                               "checkpoints there are kept (this one stays an unfinished .partial, never loaded): free space, then resume")
    return CheckpointError(f"saving step {step} into {folder} failed: {type(cause).__name__}: {first_line(cause)}")


def _clear_unfinished(folder: Location) -> None:
    """Make way for a save into ``folder``: a leftover there is a save of ours cut short (never a usable
    checkpoint: a complete one is refused before, layout.refuse_overwrite) when it holds only the files a
    save writes; anything else is not ours and is refused by name, not deleted."""
    kind = folder.kind()
    if kind is None:
        return
    strangers = layout.strangers(folder) if kind == "dir" else []
    if kind != "dir" or strangers:
        what = f"holds files a save does not write ({', '.join(strangers[:3])})" if strangers else \
            "is not a folder (a symlink or a file)"
        raise CheckpointError(layout.not_ours(folder, what))
    folder.remove()


def saves_at(step: int, interval: int, last_step: int | None) -> bool:
    """The save policy: a multiple of ``interval``, or the last step."""
    return step % interval == 0 or step == last_step


@dataclass
class LoadResult:
    path: Path | Location
    # "part" or "part.key" entries that this rank asked for and the checkpoint does not hold.
    missing: list[str] = field(default_factory=list)


class CheckpointManager:
    """Saves and loads a set of named Stateful parts with DCP, under ``folder/step-N``.

    Args:
        folder: where the ``step-N`` checkpoints go (shared by all ranks): a path, or a URL (storage.py).
        parts: ``{name: Stateful}``, e.g. from :func:`checkpoint.states.checkpoint_parts`.
        interval: :meth:`save` saves every ``interval`` steps and at the last step.
        enable: False: :meth:`save` only saves when forced.
        keep_latest_k: keep only the newest k complete checkpoints (0: all).
        rank: this process's rank (rank 0 renames and prunes).
        async_mode: "disabled" or "async" (saves other than the last one are written in the background).
        hooks: test hooks called at named moments of a save; None in a normal run.
        log: where rank 0's "checkpoint saved" lines go; None: nowhere.
        signing: the key that signs each checkpoint's checksums (integrity.py); None: unsigned.
        owner: the run ``folder`` belongs to (owner.py): the first save claims the folder for it, or is refused
            when another run's; None: the folder is not claimed.
    """

    def __init__(self, folder: Where, parts: dict[str, Stateful], *, interval: int,
                 enable: bool = True, keep_latest_k: int = 0, rank: int = 0, async_mode: str = "disabled",
                 hooks: SaveHooks | None = None, log: Callable[[str], None] | None = None,
                 signing: integrity.SigningKey | None = None, owner: str | None = None) -> None:
        self.folder = folder_location(folder)
        self.completion = layout.completion(self.folder)  # how a save becomes complete there
        if enable:
            self.folder.check()
        self.signing = signing
        self.owner = owner  # None once claimed
        self.parts = parts
        self.interval = interval
        self.enable = enable
        self.keep_latest_k = keep_latest_k
        self.rank = rank
        self.async_mode = async_mode
        self.hooks = hooks
        self.log = log if rank == 0 else None
        self.last_saved_step: int | None = None
        self._pending: tuple[int, Future, float] | None = None  # the background save: step, future, start time
        self._background_group: Any = None
        self._stager: HostCopyStager | None = None
        self._kept: set[int] = set()  # pruned steps kept for what the run did not write (said once each)
        # The run's record (run_record.py), written into every checkpoint when set.
        self.run_record: dict[str, Any] | None = None

    def should_save(self, step: int, last_step: int | None = None) -> bool:
        """The policy: a multiple of ``interval``, or the last step."""
        return self.enable and saves_at(step, self.interval, last_step)

    def save(self, step: int, *, last_step: int | None = None, force: bool = False) -> Path | Location | None:
        """Call at every step boundary, on every rank (a save is a collective). Saves when the policy says so
        (or ``force``, once per step) and returns the checkpoint folder; None when nothing was saved. A
        finished background save is completed here."""
        self.poll()
        if step == self.last_saved_step:  # e.g. a stop signal right after the interval's save
            return layout.step_dir(self.folder, step) if force else None
        if not (force or self.should_save(step, last_step)):
            return None
        in_background = self.async_mode == "async" and not force and step != last_step
        return self._save(step, in_background).native

    def _save(self, step: int, in_background: bool) -> Location:
        self.wait()
        try:
            if self.rank == 0:
                self._claim(step)
            # A run resumed from an older checkpoint (own loop: load_step) must not replace a newer one it did not
            # write.
            layout.refuse_overwrite(self.folder, [step])
            return self._write(step, in_background)
        except CheckpointError:  # already one line (a leftover that is not ours)
            raise
        except (Exception, CheckpointException) as err:  # DCP's wrapper is a BaseException
            raise _save_failure(step, self.folder, err) from None

    def _write(self, step: int, in_background: bool) -> Location:
        started = time.perf_counter()
        partial = self.completion.target(self.folder, step)
        if self.rank == 0:
            _clear_unfinished(partial)
            partial.makedirs()
        barrier()
        planner = self.hooks.save_planner(step) if self.hooks else None
        self.last_saved_step = step
        if in_background:
            future = dcp.async_save(dict(self.parts), storage_writer=dcp_io.writer(partial),
                                    process_group=self._group(), async_stager=self._staging(), planner=planner)
            self._pending = (step, future, started)
            self._say(f"checkpoint step-{step}: staged in {time.perf_counter() - started:.2f} s, writing in the "
                      "background")
            return layout.step_location(self.folder, step)
        dcp.save(dict(self.parts), storage_writer=dcp_io.writer(partial), planner=planner)
        self._hook("save_written", step)
        barrier()
        if self.rank == 0:
            self._complete(step)
        barrier()
        saved = layout.step_location(self.folder, step)
        self._say(f"checkpoint {saved} saved in {time.perf_counter() - started:.2f} s")
        return saved

    def _claim(self, step: int) -> None:
        if self.owner is None:
            return
        holder = owner.claim(self.folder, self.owner)
        if holder != self.owner and owner.moves_with(self.folder, self.owner):  # a copied or moved run's own
            owner.hand_over(self.folder, self.owner)
        elif holder != self.owner:
            raise CheckpointError(f"saving step {step} into {self.folder} refused: that folder belongs to the run of "
                                  f"dump folder {holder} ({owner.OWNER_NAME}), and two runs saving into one folder "
                                  "write over each other's checkpoints: give this run its own checkpoint folder")
        self.owner = None

    def _say(self, message: str) -> None:
        if self.log is not None:
            self.log(message)

    def _hook(self, point: str, step: int) -> None:
        if self.hooks is not None:
            self.hooks.at(point, step)

    def _group(self) -> Any:
        """The background write's own gloo group: its collectives must not interleave with the training
        loop's on the default group (created once, by every rank, at the first async save)."""
        if self._background_group is None and dist.is_initialized():
            self._background_group = dist.new_group(backend="gloo")
        return self._background_group

    def _staging(self) -> HostCopyStager:
        """One stager for the whole run: it keeps its host buffers between saves."""
        if self._stager is None:
            self._stager = HostCopyStager()
        return self._stager

    def poll(self) -> None:
        """Finish the background save if its write is done; never blocks."""
        if self._pending is not None and self._pending[1].done():
            self.wait()

    def wait(self) -> None:
        """Block until the background save, if any, is written everywhere; then rank 0 renames it."""
        if self._pending is None:
            return
        step, future, started = self._pending
        self._pending = None
        try:
            future.result()
        except (Exception, dcp.CheckpointException) as err:  # DCP's wrapper is a BaseException
            raise _save_failure(step, self.folder, err) from None
        # DCP's coordinator (rank 0) writes .metadata after every rank's write: its future done means all are.
        if self.rank == 0:
            self._complete(step)
        self._say(f"checkpoint {layout.step_dir(self.folder, step)} saved in {time.perf_counter() - started:.2f} s "
                  "(background)")

    def close(self, *, abandon: bool = False) -> None:
        """End of the run: finish a background save, or with ``abandon`` (the run failed) leave it
        unrenamed — a ``.partial`` folder is never picked."""
        if abandon:
            self._pending = None
        else:
            self.wait()
        if self._stager is not None:
            self._stager.close()

    def _complete(self, step: int) -> None:
        partial = self.completion.target(self.folder, step)
        if self.run_record is not None:
            run_record.write_record(partial, self.run_record)
        integrity.write_checksums(partial, self.signing)  # it covers every file above
        self._hook("save_marking", step)
        layout.write_marker(partial, step)  # last: from here on it counts (on an object store)
        self.completion.finish(self.folder, step)
        self._hook("save_renamed", step)
        saved = layout.step_location(self.folder, step)
        if not layout.holds_step(saved, step):  # never "saved" for what another process changed meanwhile
            raise CheckpointError(f"saving step {step} into {self.folder} failed: {saved} is not complete after "
                                  f"the save (no {layout.METADATA_NAME} or {layout.MARKER_NAME} of step {step}): "
                                  "another process writes into this folder; give each run its own checkpoint "
                                  "folder, then resume from the newest complete checkpoint")
        self._prune(step)

    def _prune(self, step: int) -> None:
        """Delete complete checkpoints older than the newest ``keep_latest_k``: only folders this code wrote
        (layout.scan), never an entry it did not, nor one holding a file it did not write (layout.strangers)."""
        for leftover in self.completion.leftovers(self.folder):
            leftover.remove()
        if self.keep_latest_k <= 0:
            return
        for old in layout.complete_steps(self.folder)[: -self.keep_latest_k]:
            checkpoint = layout.step_location(self.folder, old)
            strangers = layout.strangers(checkpoint)
            if strangers:  # not the run's to delete: the whole checkpoint stays, said once
                if old not in self._kept:
                    self._kept.add(old)
                    self._say(f"note: {checkpoint} is kept by keep_latest_k: it holds files a save does not "
                              f"write ({', '.join(strangers[:3])}), which are not this run's to delete")
                continue
            doomed = self.completion.retire(self.folder, old)
            self._hook("prune", step)
            doomed.remove()

    def load(self, checkpoint: CheckpointInfo | Where, exclude: list[str] | tuple[str, ...] = ()) -> LoadResult:
        """Load every part not excluded; keys this rank needs but the checkpoint lacks are reported.
        ``checkpoint``: a folder, or what :func:`inspect_checkpoint` read from it (not read again)."""
        info = checkpoint if isinstance(checkpoint, CheckpointInfo) else inspect_checkpoint(checkpoint)
        stored = info.keys
        result = LoadResult(path=info.path.native)
        state: dict[str, Any] = {}
        for name, part in self.parts.items():
            if name in exclude:
                continue
            if not info.holds(name):
                result.missing.append(name)
                continue
            part_state = part.state_dict()
            for key in [k for k in part_state if layout.is_per_rank_key(k)]:
                if f"{name}.{key}" not in stored:
                    result.missing.append(f"{name}.{key}")
                    del part_state[key]
            state[name] = part_state
        try:
            dcp.load(state, storage_reader=dcp_io.reader(info.path, info.metadata), planner=SafeLoadPlanner())
        except (Exception, CheckpointException) as err:  # DCP's wrapper is a BaseException
            cause = _first_failure(err) if isinstance(err, CheckpointException) else err
            if isinstance(cause, CheckpointError):
                raise cause from None
            raise CheckpointError(f"checkpoint {info.path} does not fit this run: {first_line(cause)}; resume with "
                                  "the model and config it was saved with, or use another dump folder") from None
        for name, part_state in state.items():
            self.parts[name].load_state_dict(part_state)
        return result
