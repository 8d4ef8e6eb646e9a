"""Saves and loads a run's named parts with torch.distributed.checkpoint, and owns the save policy.

``save(step, last_step=...)`` is called at every step boundary and decides: nothing when checkpointing is
off or the step is not a multiple of ``interval``; a blocking save at the last step; otherwise, with
``async_mode = "async"``, a background save (a host copy of every part is staged at the step boundary —
the RNG, dataloader and train state of that boundary — and DCP writes it in a background thread). It also
finishes a background save whose write is done. ``save(step, force=True)`` saves now whatever the policy
(a stop signal). The folder layout and crash-safety rules are in layout.py: a save is written to
``step-N.partial`` and renamed once every rank has finished (for a background save: once its write has
finished everywhere), so a ``step-N`` folder is always complete.

Errors name this class's parameters; test hooks (fault injection) are handed in, never imported here.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.planner import SavePlanner

from torchtitan_rng.checkpoint import integrity, layout, run_record
from torchtitan_rng.checkpoint.layout import first_line
from torchtitan_rng.errors import CheckpointError
from torchtitan_rng.checkpoint.safe_load import CheckpointInfo, SafeFileSystemReader, SafeLoadPlanner, inspect_checkpoint
from torchtitan_rng.checkpoint.staging import HostCopyStager
from torchtitan_rng.checkpoint.writer import ChecksummedFileSystemWriter
from torchtitan_rng.checkpoint.states import Stateful
from torchtitan_rng.distributed import barrier


class SaveHooks(Protocol):
    """Called at named moments of a save (tests use them to kill a rank exactly there)."""

    def at(self, point: str, step: int) -> None: ...

    def save_planner(self, step: int) -> SavePlanner | None: ...


def _first_failure(err: CheckpointException) -> BaseException:
    """The original exception inside DCP's wrapper (one per failed rank)."""
    return next(iter(err.failures.values()))[0]


# No space left, a file-size limit, a quota: to the user, all "the disk is full".
_DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def _disk_full(err: BaseException) -> bool:
    """Whether a write failed for lack of space. torch's writer reports a short write as "unexpected pos";
    the OSError behind it is in the exception's context."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _DISK_FULL:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _save_failure(step: int, folder: Path, err: BaseException) -> CheckpointError:
    """One line for a failed save: "the disk is full" when it is, else the original error's first line."""
    cause = _first_failure(err) if isinstance(err, CheckpointException) else err
    if _disk_full(cause):
        return CheckpointError(f"saving step {step} into {folder} failed: the disk is full; the complete "
                               "checkpoints there are kept (this one stays an unfinished .partial, never loaded): free space, then resume")
    return CheckpointError(f"saving step {step} into {folder} failed: {type(cause).__name__}: {first_line(cause)}")


@dataclass
class LoadResult:
    path: Path
    # "part" or "part.key" entries that this rank asked for and the checkpoint does not hold.
    missing: list[str] = field(default_factory=list)


class CheckpointManager:
    """Saves and loads a set of named Stateful parts with DCP, under ``folder/step-N``.

    Args:
        folder: where the ``step-N`` checkpoints go (shared by all ranks).
        parts: ``{name: Stateful}``, e.g. from :func:`checkpoint.states.checkpoint_parts`.
        interval: :meth:`save` saves every ``interval`` steps and at the last step.
        enable: False: :meth:`save` only saves when forced.
        keep_latest_k: keep only the newest k complete checkpoints (0: all).
        rank: this process's rank (rank 0 renames and prunes).
        async_mode: "disabled" or "async" (saves other than the last one are written in the background).
        hooks: test hooks called at named moments of a save; None in a normal run.
        log: where rank 0's "checkpoint saved" lines go; None: nowhere.
    """

    def __init__(self, folder: Path, parts: dict[str, Stateful], *, interval: int, enable: bool = True,
                 keep_latest_k: int = 0, rank: int = 0, async_mode: str = "disabled",
                 hooks: SaveHooks | None = None, log: Callable[[str], None] | None = None) -> None:
        self.folder = folder
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
        # The run's record (run_record.py), written into every checkpoint when set.
        self.run_record: dict[str, Any] | None = None

    def should_save(self, step: int, last_step: int | None = None) -> bool:
        """The policy: a multiple of ``interval``, or the last step."""
        return self.enable and (step % self.interval == 0 or step == last_step)

    def save(self, step: int, *, last_step: int | None = None, force: bool = False) -> Path | None:
        """Call at every step boundary, on every rank (a save is a collective). Saves when the policy says so
        (or ``force``, once per step) and returns the checkpoint folder; None when nothing was saved. A
        finished background save is completed here."""
        self.poll()
        if step == self.last_saved_step:  # e.g. a stop signal right after the interval's save
            return layout.step_dir(self.folder, step) if force else None
        if not (force or self.should_save(step, last_step)):
            return None
        in_background = self.async_mode == "async" and not force and step != last_step
        return self._save(step, in_background)

    def _save(self, step: int, in_background: bool) -> Path:
        self.wait()
        # A run resumed from an older checkpoint (own loop: load_step) must not replace a newer one it did not write.
        layout.refuse_overwrite(self.folder, [step])
        try:
            return self._write(step, in_background)
        except (Exception, CheckpointException) as err:  # DCP's wrapper is a BaseException
            raise _save_failure(step, self.folder, err) from None

    def _write(self, step: int, in_background: bool) -> Path:
        started = time.perf_counter()
        partial = layout.partial_dir(self.folder, step)
        if self.rank == 0:
            # A leftover .partial of this step is an unfinished save of ours: never a usable checkpoint.
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        barrier()
        planner = self.hooks.save_planner(step) if self.hooks else None
        self.last_saved_step = step
        if in_background:
            future = dcp.async_save(dict(self.parts), storage_writer=ChecksummedFileSystemWriter(partial),
                                    process_group=self._group(), async_stager=self._staging(), planner=planner)
            self._pending = (step, future, started)
            self._say(f"checkpoint step-{step}: staged in {time.perf_counter() - started:.2f} s, writing in the "
                      "background")
            return layout.step_dir(self.folder, step)
        dcp.save(dict(self.parts), storage_writer=ChecksummedFileSystemWriter(partial), planner=planner)
        self._hook("save_written", step)
        barrier()
        if self.rank == 0:
            self._complete(step)
        barrier()
        self._say(f"checkpoint {layout.step_dir(self.folder, step)} saved in {time.perf_counter() - started:.2f} s")
        return layout.step_dir(self.folder, step)

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
        partial = layout.partial_dir(self.folder, step)
        if self.run_record is not None:
            run_record.write_record(partial, self.run_record)
        integrity.write_checksums(partial)  # last: it covers every file above
        os.replace(partial, layout.step_dir(self.folder, step))
        self._hook("save_renamed", step)
        self._prune(step)

    def _prune(self, step: int) -> None:
        for leftover in self.folder.glob(f"step-*{layout.DELETING_SUFFIX}"):  # from a prune that was killed
            shutil.rmtree(leftover, ignore_errors=True)
        if self.keep_latest_k <= 0:
            return
        for old in layout.complete_steps(self.folder)[: -self.keep_latest_k]:
            doomed = layout.deleting_dir(self.folder, old)
            os.replace(layout.step_dir(self.folder, old), doomed)  # atomic: never a half-deleted step-N
            self._hook("prune", step)
            shutil.rmtree(doomed, ignore_errors=True)

    def load(self, checkpoint: CheckpointInfo | Path, exclude: list[str] | tuple[str, ...] = ()) -> LoadResult:
        """Load every part not excluded; keys this rank needs but the checkpoint lacks are reported.
        ``checkpoint``: a folder, or what :func:`inspect_checkpoint` read from it (not read again)."""
        info = checkpoint if isinstance(checkpoint, CheckpointInfo) else inspect_checkpoint(Path(checkpoint))
        stored = info.keys
        result = LoadResult(path=info.path)
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
            dcp.load(state, storage_reader=SafeFileSystemReader(info.path, info.metadata), planner=SafeLoadPlanner())
        except (Exception, CheckpointException) as err:  # DCP's wrapper is a BaseException
            cause = _first_failure(err) if isinstance(err, CheckpointException) else err
            if isinstance(cause, CheckpointError):
                raise cause from None
            raise CheckpointError(f"checkpoint {info.path} does not fit this run: {first_line(cause)}; resume with "
                                  "the model and config it was saved with, or use another dump folder") from None
        for name, part_state in state.items():
            self.parts[name].load_state_dict(part_state)
        return result
