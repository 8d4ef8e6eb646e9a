"""Checkpoints on torch.distributed.checkpoint: step-N folders, only complete ones picked, safe loading.

A save writes ``step-N.partial`` and rank 0 renames it to ``step-N`` once every rank has finished, so a
folder named ``step-N`` with DCP's ``.metadata`` is complete by construction: a crash mid-save leaves
only a ``.partial`` folder, which is never picked. Pruning renames ``step-N`` to ``step-N.deleting``
before deleting it, so a crash mid-prune never leaves a half-deleted ``step-N`` either. A ``step-N``
without ``.metadata`` is therefore not ours (a copy cut short, a damaged disk) and is reported, not skipped.

Loading never unpickles code: ``.metadata`` goes through an unpickler that knows only DCP's metadata
classes, and non-tensor items through ``torch.load(weights_only=True)``.

With ``checkpoint.async_mode = "async"`` a save stages a copy of every part at the step boundary (the RNG,
dataloader and train state of that boundary), returns, and DCP writes the copy in a background thread;
the rename to ``step-N`` happens once the write has finished everywhere (seen at the next save, at a
poll, or at the end of training), so the guarantee above holds unchanged.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import sys
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torchtitan_rng.distributed import barrier
from torchtitan_rng.checkpoint import integrity, run_record
from torchtitan_rng.checkpoint.staging import HostCopyStager
from torchtitan_rng.fault_injection import fault_point, save_planner

_STEP_DIR = re.compile(r"^step-(\d+)$")
# Per-rank entries (TrainState's rank_{r}, the dataloader's dp_rank_{r}): a checkpoint saved with another
# world size may have none for this rank, which the caller decides about; any other missing key is an error.
_PER_RANK_KEY = re.compile(r"^(dp_)?rank_\d+$")
PARTIAL_SUFFIX = ".partial"
DELETING_SUFFIX = ".deleting"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message is one line saying which and why."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor items with ``weights_only=False`` (it can run code).
    This one only accepts plain data: tensors, numbers, strings, bytes, lists, tuples and dicts."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as err:  # the unpickler's refusal, whatever its type
            raise CheckpointError(
                f"refusing to load checkpoint item {fqn!r}: it is not plain data ({type(err).__name__}); "
                "the checkpoint may be crafted to run code"
            ) from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # DCP's own helper

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle; DCP reads it with plain ``pickle.load``. This accepts only the
    classes a DCP metadata file is made of."""

    _METADATA_MODULE = "torch.distributed.checkpoint.metadata"  # plain dataclasses and enums only
    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("pathlib", "PosixPath"),
                ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module in ("torch", self._METADATA_MODULE):
            found = getattr(torch if module == "torch" else sys.modules[module], name, None)
            if isinstance(found, torch.dtype) or (module == self._METADATA_MODULE and isinstance(found, type)):
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with a ``.metadata`` unpickler that cannot run code."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(os.path.join(self.path, ".metadata"), "rb") as file:
            metadata = _MetadataUnpickler(file).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


def verify_checkpoint(path: Path) -> Metadata:
    """The metadata of a complete, undamaged checkpoint: every shard file there and long enough."""
    try:
        metadata = SafeFileSystemReader(str(path)).read_metadata()
    except Exception as err:  # a missing, truncated or crafted .metadata, whatever the error type
        raise CheckpointError(
            f"checkpoint {path} cannot be read: its .metadata is missing or damaged ({type(err).__name__}: "
            f"{_first_line(err)}); pick another with --checkpoint.load_step"
        ) from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise CheckpointError(f"checkpoint {path} is damaged: shard file {name} is missing; pick another "
                                  "with --checkpoint.load_step")
        if shard.stat().st_size < size:
            raise CheckpointError(f"checkpoint {path} is damaged: shard file {name} is truncated "
                                  f"({shard.stat().st_size} bytes, {size} expected); pick another with "
                                  "--checkpoint.load_step")
    return metadata


def verify_integrity(path: Path) -> bool:
    """Every file of the checkpoint as written (False: it has no checksums, saved by an older version);
    CheckpointError naming a damaged file. Reads every byte: call it once per resume, on one rank."""
    try:
        return integrity.verify_checksums(path)
    except integrity.DamagedFile as err:
        raise CheckpointError(f"checkpoint {path} is damaged: {err}; pick another with --checkpoint.load_step "
                              "(or move it away)") from None


def _first_line(err: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters), else its type's name."""
    lines = str(err).strip().splitlines()
    return lines[0][:300] if lines else type(err).__name__


def _first_failure(err: CheckpointException) -> BaseException:
    """The original exception inside DCP's wrapper (one per failed rank)."""
    return next(iter(err.failures.values()))[0]


class ModelState:
    """The model's (possibly FSDP-sharded) weights as a Stateful, via DCP's state_dict helpers."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState:
    """The optimizer keyed by parameter names (flattened), so DCP can reshard it."""

    _options = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer, options=self._options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=self._options)


def complete_steps(folder: Path) -> list[int]:
    """Steps of the complete checkpoints in ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    steps = []
    for entry in folder.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / ".metadata").is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def damaged_steps(folder: Path) -> list[int]:
    """Steps of ``step-N`` folders without DCP's ``.metadata`` (never left by this code, see above)."""
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for entry in folder.iterdir()
                  if (m := _STEP_DIR.match(entry.name)) and not (entry / ".metadata").is_file())


def _refuse_damaged(folder: Path, complete: list[int], load_step: int) -> None:
    """Refuse a ``step-N`` without ``.metadata`` that would be picked: asked for, or newer than all others."""
    newest = max(complete, default=-1)
    picked = [s for s in damaged_steps(folder) if (s == load_step if load_step >= 0 else s > newest)]
    if picked:
        raise CheckpointError(
            f"checkpoint folder {step_dir(folder, picked[-1])} is incomplete (no .metadata: empty, or a copy cut "
            "short); move it away, or pick another checkpoint with --checkpoint.load_step"
        )


def step_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step}"


def _describe(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"


def resolve_checkpoint(own_folder: Path, load_step: int, initial_load_path: str) -> Path | None:
    """The checkpoint a run starts from: its own newest (or ``load_step``), else ``initial_load_path``."""
    own = complete_steps(own_folder)
    _refuse_damaged(own_folder, own, load_step)
    if load_step >= 0 and load_step in own:
        return step_dir(own_folder, load_step)
    if own and load_step < 0:
        return step_dir(own_folder, own[-1])
    if initial_load_path:
        initial = Path(initial_load_path)
        if (initial / ".metadata").is_file() and load_step < 0:
            return initial
        if not initial.is_dir():
            raise CheckpointError(
                f"checkpoint.initial_load_path {initial_load_path!r} does not exist; give a step-N folder "
                "or a folder of them"
            )
        found = complete_steps(initial)
        _refuse_damaged(initial, found, load_step)
        if load_step >= 0:
            if load_step not in found:
                raise CheckpointError(
                    f"checkpoint.load_step {load_step} not found in {initial}; complete checkpoints there: "
                    f"{_describe(found)}"
                )
            return step_dir(initial, load_step)
        if not found:
            raise CheckpointError(
                f"checkpoint.initial_load_path {initial_load_path!r} holds no complete checkpoint "
                "(a folder with DCP's .metadata, or step-N folders of them)"
            )
        return step_dir(initial, found[-1])
    if load_step >= 0:
        raise CheckpointError(
            f"checkpoint.load_step {load_step} not found in {own_folder}; complete checkpoints there: "
            f"{_describe(own)}"
        )
    return None


def refuse_overwrite(folder: Path, planned_saves: list[int]) -> None:
    """A run resumed from an older checkpoint must not save over a newer one of an earlier history."""
    taken = sorted(set(planned_saves) & set(complete_steps(folder)))
    if taken:
        raise CheckpointError(
            f"this run would save over the existing checkpoints {_describe(taken)} in {folder}; resume into a "
            "fresh dump folder with --checkpoint.initial_load_path, or move those checkpoints away"
        )


@dataclass
class LoadResult:
    path: Path
    # "part" or "part.key" entries that this rank asked for and the checkpoint does not hold.
    missing: list[str] = field(default_factory=list)


class CheckpointManager:
    """Saves and loads a set of named Stateful parts with DCP, under ``folder/step-N``."""

    def __init__(self, folder: Path, parts: dict[str, Stateful], *, interval: int, keep_latest_k: int = 0,
                 rank: int = 0, async_mode: str = "disabled") -> None:
        self.folder = folder
        self.parts = parts
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.rank = rank
        self.async_mode = async_mode
        self._pending: tuple[int, Future] | None = None  # the background save: (step, its future)
        self._background_group: Any = None
        self._stager: HostCopyStager | None = None
        # The run's record (run_record.py), written into every checkpoint when set.
        self.run_record: dict[str, Any] | None = None

    def should_save(self, step: int, last_step: int) -> bool:
        return step % self.interval == 0 or step == last_step

    def save(self, step: int, *, blocking: bool = True) -> Path:
        """Write every part at this step boundary (a collective: all ranks call it). With async_mode "async"
        and ``blocking=False`` only the staging copy happens now; the write goes on in the background."""
        self.wait()
        final = step_dir(self.folder, step)
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        if self.rank == 0:
            # A leftover .partial of this step is an unfinished save of ours: never a usable checkpoint.
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        barrier()
        if self.async_mode == "async" and not blocking:
            future = dcp.async_save(dict(self.parts), checkpoint_id=str(partial), process_group=self._group(),
                                    async_stager=self._staging(), planner=save_planner(step, self.rank))
            self._pending = (step, future)
            return final
        dcp.save(dict(self.parts), checkpoint_id=str(partial), planner=save_planner(step, self.rank))
        fault_point("save_written", step, self.rank)
        barrier()
        if self.rank == 0:
            self._complete(step)
        barrier()
        return final

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
        """Finish the background save if its write is done; never blocks (call it once a step)."""
        if self._pending is not None and self._pending[1].done():
            self.wait()

    def wait(self) -> None:
        """Block until the background save, if any, is written everywhere; then rank 0 renames it."""
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        try:
            future.result()
        except (Exception, dcp.CheckpointException) as err:  # DCP's wrapper is a BaseException
            raise CheckpointError(f"the background save of step {step} failed: {_first_line(err)}") from None
        # DCP's coordinator (rank 0) writes .metadata after every rank's write: its future done means all are.
        if self.rank == 0:
            self._complete(step)

    def _complete(self, step: int) -> None:
        final = step_dir(self.folder, step)
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        if self.run_record is not None:
            run_record.write_record(partial, self.run_record)
        integrity.write_checksums(partial)  # last: it covers every file above
        os.replace(partial, final)
        fault_point("save_renamed", step, self.rank)
        self._prune(step)

    def _prune(self, step: int) -> None:
        for leftover in self.folder.glob(f"step-*{DELETING_SUFFIX}"):  # from a prune that was killed
            shutil.rmtree(leftover, ignore_errors=True)
        if self.keep_latest_k <= 0:
            return
        for old in complete_steps(self.folder)[: -self.keep_latest_k]:
            doomed = step_dir(self.folder, old).with_name(f"step-{old}{DELETING_SUFFIX}")
            os.replace(step_dir(self.folder, old), doomed)  # atomic: never a half-deleted step-N
            fault_point("prune", step, self.rank)
            shutil.rmtree(doomed, ignore_errors=True)

    def load(self, path: Path, exclude: list[str] | tuple[str, ...] = ()) -> LoadResult:
        """Load every part not excluded; keys this rank needs but the checkpoint lacks are reported."""
        stored = set(verify_checkpoint(path).state_dict_metadata)
        result = LoadResult(path=path)
        state: dict[str, Any] = {}
        for name, part in self.parts.items():
            if name in exclude:
                continue
            if not any(key.startswith(name + ".") for key in stored):
                result.missing.append(name)
                continue
            part_state = part.state_dict()
            for key in [k for k in part_state if _PER_RANK_KEY.match(k)]:
                if f"{name}.{key}" not in stored:
                    result.missing.append(f"{name}.{key}")
                    del part_state[key]
            state[name] = part_state
        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner())
        except (Exception, CheckpointException) as err:  # DCP's wrapper is a BaseException
            cause = _first_failure(err) if isinstance(err, CheckpointException) else err
            if isinstance(cause, CheckpointError):
                raise cause from None
            raise CheckpointError(f"checkpoint {path} does not fit this run: {_first_line(cause)}; resume with the "
                                  "model and config it was saved with, or use another dump folder") from None
        for name, part_state in state.items():
            self.parts[name].load_state_dict(part_state)
        return result
