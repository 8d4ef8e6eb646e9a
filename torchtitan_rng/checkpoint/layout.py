"""The checkpoint layout, in one place: part names, per-rank keys, ``step-N`` folders and which one a run
starts from.

A checkpoint counts only when complete, and only when this code wrote it:

* On a storage that renames atomically (a local folder, storage.py), a save writes ``step-N.partial`` and
  renames it to ``step-N`` once every rank has finished, so a ``step-N`` folder with DCP's ``.metadata`` is
  complete by construction: a crash mid-save leaves only a ``.partial`` folder, which is never picked.
  Pruning renames ``step-N`` to ``step-N.deleting`` before deleting it, so a crash mid-prune never leaves a
  half-deleted ``step-N`` either. A ``step-N`` folder without ``.metadata`` is therefore not ours (a copy cut
  short, a damaged disk) and is reported, not skipped.
* On an object store (no rename), a save writes ``step-N/`` in place and ``complete.json`` (the completion
  marker, ``{"step": N}``) last, after the checksums; a ``step-N/`` without it is a save cut short, never
  picked. Pruning deletes the marker first.

Either way the marker, written last, names the step the folder was saved as. Entries named ``step-N`` that
this code did not write are ignored by name (:func:`ignored_entries`), never followed, renamed or deleted:
anything that is not a real folder (a symlink, dangling or looping; a file), or a folder whose marker names
another step (a copy under another name).

Errors name the parameters of the functions here (``load_step=``); the trainer words them as its flags
(``config.as_flags``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from torchtitan_rng.checkpoint.storage import Location, Where, locate
from torchtitan_rng.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

# The parts every checkpoint of a run holds, by name (the top-level keys of DCP's state dict).
MODEL = "model"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
DATALOADER = "dataloader"
TRAIN_STATE = "train_state"
PARTS = (MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE)

PARTIAL_SUFFIX = ".partial"
DELETING_SUFFIX = ".deleting"
MARKER_NAME = "complete.json"  # written last into a finished save: {"step": N}
METADATA_NAME = ".metadata"  # DCP's index
RECORD_NAME = "run.json"  # run_record.py
CHECKSUMS_NAME = "checksums.json"  # integrity.py
SIGNATURE_NAME = "signature.json"  # integrity.py, with a signing key
# Every file a save writes into its folder: anything else there is not the run's (strangers()).
_OUR_FILES = re.compile(r"^(\.metadata(\.tmp)?|__\d+_\d+\.distcp|"
                        + "|".join(re.escape(name) for name in (RECORD_NAME, CHECKSUMS_NAME, SIGNATURE_NAME,
                                                                MARKER_NAME)) + ")$")
_STEP_DIR = re.compile(r"^step-(\d+)$")
_DELETING = re.compile(r"^step-\d+" + re.escape(DELETING_SUFFIX) + "$")
# Per-rank values live under rank-unique keys: DCP keeps only one copy of a same-key non-DTensor value saved
# from every rank, so a shared key would hand every rank rank 0's value on load.
_PER_RANK_KEY = re.compile(r"^(dp_)?rank_(\d+)$")


def rank_key(rank: int) -> str:
    """The key of a rank's own value (TrainState's random streams)."""
    return f"rank_{rank}"


def dp_rank_key(dp_rank: int) -> str:
    """The key of a data-parallel rank's own value (the dataloader's position)."""
    return f"dp_rank_{dp_rank}"


def is_per_rank_key(key: str) -> bool:
    """A key that only one rank saved (see rank_key, dp_rank_key); another world size may lack it."""
    return _PER_RANK_KEY.match(key) is not None


def saved_world_size(keys: Iterable[str]) -> int | None:
    """How many processes saved a checkpoint with these (dotted) keys; None without per-rank train state."""
    prefix = TRAIN_STATE + "."
    count = sum(1 for key in keys if key.startswith(prefix) and key[len(prefix):].startswith("rank_")
                and is_per_rank_key(key[len(prefix):]))
    return count or None


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint holds, read once: its folder, DCP metadata, and the keys derived from them."""

    path: Location
    metadata: Metadata

    @property
    def keys(self) -> frozenset[str]:
        """Dotted keys of every stored value (``train_state.rank_0``, ``model.tok_embeddings.weight``)."""
        return frozenset(self.metadata.state_dict_metadata)

    @property
    def saved_world_size(self) -> int | None:
        """How many processes saved it (None: it has no per-rank train state)."""
        return saved_world_size(self.keys)

    def holds(self, part: str) -> bool:
        return any(key.startswith(part + ".") for key in self.metadata.state_dict_metadata)


def step_location(folder: Where, step: int) -> Location:
    """The folder of the checkpoint of ``step``."""
    return locate(folder) / f"step-{step}"


def step_dir(folder: Where, step: int) -> Path | Location:
    """:func:`step_location` as the public API hands it out (a ``Path`` when local)."""
    return step_location(folder, step).native


def partial_dir(folder: Where, step: int) -> Location:
    """Where the save of ``step`` is written before it is complete (where folders are renamed atomically)."""
    return locate(folder) / f"step-{step}{PARTIAL_SUFFIX}"


def deleting_dir(folder: Where, step: int) -> Location:
    """Where a pruned ``step-N`` goes before it is deleted (where folders are renamed atomically)."""
    return locate(folder) / f"step-{step}{DELETING_SUFFIX}"


class Renamed:
    """The completion rule of a storage that renames folders atomically (a local folder): a save is written to
    ``step-N.partial`` and renamed to ``step-N`` once complete; a pruned checkpoint is renamed to
    ``step-N.deleting`` before it is deleted. A ``step-N`` folder with ``.metadata`` and no marker is one from
    before markers, which the rename alone made complete; without ``.metadata`` it is damaged."""

    unmarked = "damaged"  # what a step-N folder without a marker (nor .metadata) is
    without_checksums = "saved by an older version"  # why a complete checkpoint may have no checksums

    def target(self, folder: Location, step: int) -> Location:
        return partial_dir(folder, step)

    def finish(self, folder: Location, step: int) -> None:
        """After the marker: make the save ``step-N``."""
        folder.storage.rename(partial_dir(folder, step).path, step_location(folder, step).path)

    def complete_unmarked(self, checkpoint: Location) -> bool:
        return (checkpoint / METADATA_NAME).is_file()

    def retire(self, folder: Location, step: int) -> Location:
        """Take a checkpoint out of the complete ones in one atomic step; returns what is left to delete."""
        doomed = deleting_dir(folder, step)
        folder.storage.rename(step_location(folder, step).path, doomed.path)  # never a half-deleted step-N
        return doomed

    def leftovers(self, folder: Location) -> list[Location]:
        """What a prune that was killed left to delete."""
        return [entry for entry in folder.entries() if _DELETING.match(entry.name) and entry.is_dir()]


class Marked:
    """The completion rule of an object store (no rename): a save is written to ``step-N/`` in place and counts
    once its marker, written last, is there; pruning deletes the marker first. Without a marker a ``step-N/``
    is a save cut short, never picked."""

    unmarked = "unfinished"
    without_checksums = f"its {CHECKSUMS_NAME} was removed or never written"  # every save on a store wrote one

    def target(self, folder: Location, step: int) -> Location:
        return step_location(folder, step)

    def finish(self, folder: Location, step: int) -> None:
        """Nothing after the marker: it made the save complete."""

    def complete_unmarked(self, checkpoint: Location) -> bool:
        return False

    def retire(self, folder: Location, step: int) -> Location:
        checkpoint = step_location(folder, step)
        (checkpoint / MARKER_NAME).remove()  # first: from here on it never counts
        return checkpoint

    def leftovers(self, folder: Location) -> list[Location]:
        return []


def completion(folder: Where) -> Renamed | Marked:
    """The completion rule of the storage ``folder`` is on: the one place that asks whether it renames."""
    return Renamed() if locate(folder).storage.atomic_rename else Marked()


def write_marker(checkpoint: Location, step: int) -> None:
    """The last file of a save: from here on ``checkpoint`` counts as the complete checkpoint of ``step``."""
    (checkpoint / MARKER_NAME).write_text(json.dumps({"step": step}) + "\n")


def _marked_step(checkpoint: Location) -> int | None:
    """The step the marker names; None without a marker; -1 for one that is not ours (unreadable)."""
    marker = checkpoint / MARKER_NAME
    if not marker.is_file():
        return None
    try:
        step = json.loads(marker.read_text())["step"]
    except (OSError, ValueError, TypeError, KeyError):
        return -1
    return step if isinstance(step, int) else -1


@dataclass
class Scan:
    """The ``step-N`` entries of a checkpoint folder, by what they are."""

    complete: list[int] = field(default_factory=list)
    damaged: list[int] = field(default_factory=list)  # a folder that cannot be a save of ours (no .metadata)
    unfinished: list[int] = field(default_factory=list)  # on an object store: a save cut short (no marker)
    ignored: list[str] = field(default_factory=list)  # one line per entry this code did not write
    # The step-N entries a save of N must not land on, by step: what this code did not write (each named).
    foreign: dict[int, str] = field(default_factory=dict)


def scan(folder: Where) -> Scan:
    """Every ``step-N`` entry of ``folder``, without following a link or reading more than the markers."""
    folder = locate(folder)
    rule = completion(folder)
    found = Scan()
    for entry in folder.entries():
        match = _STEP_DIR.match(entry.name)
        if not match:
            continue
        step = int(match.group(1))
        kind = entry.kind()
        if kind != "dir":
            what = "a symlink or special file" if kind == "other" else "a file"
            found.ignored.append(f"{entry} is {what}, not a checkpoint this run wrote: ignored (never followed, "
                                 "renamed or deleted)")
            found.foreign[step] = not_ours(entry, f"is {what}")
            continue
        marked = _marked_step(entry)
        if marked is not None and marked != step:
            found.ignored.append(f"{entry} holds a checkpoint saved as another step (its {MARKER_NAME} names "
                                 f"{marked}): ignored; give it as initial_load_path= to start from it")
            found.foreign[step] = not_ours(entry, f"holds a checkpoint saved as step {marked} (a copy)")
        elif marked is not None or rule.complete_unmarked(entry):
            found.complete.append(step)
        elif rule.unmarked == "damaged":
            found.damaged.append(step)
            found.foreign[step] = not_ours(entry, "is a folder without .metadata")
        else:
            found.unfinished.append(step)  # a save of ours cut short, redone by the next save of its step...
            others = strangers(entry)
            if others:  # ...unless it holds what no save writes
                found.foreign[step] = not_ours(entry, f"holds files a save does not write ({', '.join(others[:3])})")
    for steps in (found.complete, found.damaged, found.unfinished):
        steps.sort()
    return found


def complete_steps(folder: Where) -> list[int]:
    """Steps of the complete checkpoints in ``folder``, oldest first."""
    return scan(folder).complete


def damaged_steps(folder: Where) -> list[int]:
    """Steps of ``step-N`` folders without DCP's ``.metadata`` (never left by this code, see above)."""
    return scan(folder).damaged


def ignored_entries(folder: Where) -> list[str]:
    """One line per ``step-N`` entry of ``folder`` that this code did not write (see above)."""
    return scan(folder).ignored


def not_ours(entry: Location, what: str) -> str:
    """The refusal of a save into ``entry``, which ``what`` says the run did not write."""
    return f"cannot save into {entry}: it {what}; it is not this run's, so it is left as it is: move it away"


def strangers(folder: Location) -> list[str]:
    """The files below a ``step-N`` folder that no save writes (a user's notes, a copy's extras): the one rule
    for what the run did not write there, which is never deleted or written over."""
    return [name for name in folder.files() if not _OUR_FILES.match(name)]


def holds_step(checkpoint: Location, step: int) -> bool:
    """Whether ``checkpoint`` is the complete save of ``step``: DCP's index there, and the marker naming it."""
    return _marked_step(checkpoint) == step and (checkpoint / METADATA_NAME).is_file()


def enclosing_checkpoint(folder: Where) -> Location | None:
    """The complete checkpoint that ``folder`` is or lies inside (a checkpoint folder named there would write
    steps into it); None when there is none."""
    location = locate(folder)
    path = location.path.rstrip("/")
    while path:
        candidate = Location(location.storage, path)
        if _is_checkpoint(candidate):
            return candidate
        parent = os.path.dirname(path) if location.local is not None else path.rpartition("/")[0]
        if parent == path:  # the root
            return None
        path = parent
    return None


def _is_checkpoint(folder: Location) -> bool:
    """Whether ``folder`` itself is a complete checkpoint (whatever its name)."""
    return folder.is_dir() and (_marked_step(folder) is not None or completion(folder).complete_unmarked(folder))


def _refuse_damaged(folder: Location, found: Scan, load_step: int) -> None:
    """Refuse a ``step-N`` without ``.metadata`` that would be picked: asked for, or newer than all others."""
    newest = max(found.complete, default=-1)
    picked = [s for s in found.damaged if (s == load_step if load_step >= 0 else s > newest)]
    if picked:
        raise CheckpointError(
            f"checkpoint folder {step_dir(folder, picked[-1])} is incomplete (no .metadata: empty, or a copy cut "
            "short); move it away, or pick another checkpoint with load_step="
        )


def _describe(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"


def resolve_checkpoint(own_folder: Where, load_step: int = -1,
                       initial_load_path: Where = "") -> Path | Location | None:
    """:func:`start_location` as the public API hands it out (a ``Path`` when local)."""
    start = start_location(own_folder, load_step, initial_load_path)
    return start.native if start is not None else None


def start_location(own_folder: Where, load_step: int = -1, initial_load_path: Where = "") -> Location | None:
    """The checkpoint a run starts from: its own newest (or ``load_step``), else ``initial_load_path``."""
    own_folder = locate(own_folder)
    found = scan(own_folder)
    own = found.complete
    _refuse_damaged(own_folder, found, load_step)
    if load_step >= 0 and load_step in own:
        return step_location(own_folder, load_step)
    if own and load_step < 0:
        return step_location(own_folder, own[-1])
    if initial_load_path:
        # Named by the user: a link given here is followed (a link among a folder's step-N entries never is).
        initial = locate(initial_load_path)
        if initial.local is not None and initial.kind() == "other":
            initial = locate(initial.local.resolve())
        if _is_checkpoint(initial) and load_step < 0:
            return initial
        if not initial.is_dir():
            raise CheckpointError(
                f"initial_load_path={str(initial_load_path)!r} does not exist; give a step-N folder or a folder "
                "of them"
            )
        there = scan(initial)
        _refuse_damaged(initial, there, load_step)
        if load_step >= 0:
            if load_step not in there.complete:
                raise CheckpointError(
                    f"load_step={load_step} not found in {initial}; complete checkpoints there: "
                    f"{_describe(there.complete)}"
                )
            return step_location(initial, load_step)
        if not there.complete:
            raise CheckpointError(
                f"initial_load_path={str(initial_load_path)!r} holds no complete checkpoint (a folder with DCP's "
                ".metadata, or step-N folders of them)"
            )
        return step_location(initial, there.complete[-1])
    if load_step >= 0:
        raise CheckpointError(
            f"load_step={load_step} not found in {own_folder}; complete checkpoints there: {_describe(own)}"
        )
    return None


def refuse_overwrite(folder: Where, planned_saves: Iterable[int]) -> None:
    """Before saving ``planned_saves``: a run resumed from an older checkpoint must not save over a newer one of
    an earlier history, and no save may land on an entry the run did not write (a user's copy under another
    step's name, a symlink or file named ``step-N``, a folder holding other files). Foreseen at start, so a
    run is refused before it trains, not at the save."""
    folder = locate(folder)
    planned = set(planned_saves)
    found = scan(folder)
    taken = sorted(planned & set(found.complete))
    if taken:
        raise CheckpointError(
            f"this run would save over the existing checkpoints {_describe(taken)} in {folder}; resume "
            "into a fresh folder with initial_load_path=, or move those checkpoints away"
        )
    clash = sorted(planned & set(found.foreign))
    if clash:
        raise CheckpointError(f"this run saves step {clash[0]}: {found.foreign[clash[0]]}")
