"""The checkpoint layout, in one place: part names, per-rank keys, ``step-N`` folders and which one a run
starts from.

A save writes ``step-N.partial`` and renames it to ``step-N`` once every rank has finished, so a folder
named ``step-N`` with DCP's ``.metadata`` is complete by construction: a crash mid-save leaves only a
``.partial`` folder, which is never picked. Pruning renames ``step-N`` to ``step-N.deleting`` before
deleting it, so a crash mid-prune never leaves a half-deleted ``step-N`` either. A ``step-N`` without
``.metadata`` is therefore not ours (a copy cut short, a damaged disk) and is reported, not skipped.

Errors name the parameters of the functions here (``load_step=``); the trainer words them as its flags
(``config.as_flags``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

from torchtitan_rng.errors import CheckpointError

# The parts every checkpoint of a run holds, by name (the top-level keys of DCP's state dict).
MODEL = "model"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
DATALOADER = "dataloader"
TRAIN_STATE = "train_state"
PARTS = (MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE)

PARTIAL_SUFFIX = ".partial"
DELETING_SUFFIX = ".deleting"
_STEP_DIR = re.compile(r"^step-(\d+)$")
# Per-rank values live under rank-unique keys: DCP keeps only one copy of a same-key non-DTensor value saved
# from every rank, so a shared key would hand every rank rank 0's value on load.
_PER_RANK_KEY = re.compile(r"^(dp_)?rank_(\d+)$")


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters), else its type's name."""
    lines = str(err).strip().splitlines()
    return lines[0][:300] if lines else type(err).__name__


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


def step_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step}"


def partial_dir(folder: Path, step: int) -> Path:
    """Where the save of ``step`` is written before it is complete."""
    return folder / f"step-{step}{PARTIAL_SUFFIX}"


def deleting_dir(folder: Path, step: int) -> Path:
    """Where a pruned ``step-N`` goes before it is deleted."""
    return folder / f"step-{step}{DELETING_SUFFIX}"


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
            "short); move it away, or pick another checkpoint with load_step="
        )


def _describe(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"


def resolve_checkpoint(own_folder: Path, load_step: int = -1, initial_load_path: str | Path = "") -> Path | None:
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
                f"initial_load_path={str(initial_load_path)!r} does not exist; give a step-N folder or a folder "
                "of them"
            )
        found = complete_steps(initial)
        _refuse_damaged(initial, found, load_step)
        if load_step >= 0:
            if load_step not in found:
                raise CheckpointError(
                    f"load_step={load_step} not found in {initial}; complete checkpoints there: {_describe(found)}"
                )
            return step_dir(initial, load_step)
        if not found:
            raise CheckpointError(
                f"initial_load_path={str(initial_load_path)!r} holds no complete checkpoint (a folder with DCP's "
                ".metadata, or step-N folders of them)"
            )
        return step_dir(initial, found[-1])
    if load_step >= 0:
        raise CheckpointError(
            f"load_step={load_step} not found in {own_folder}; complete checkpoints there: {_describe(own)}"
        )
    return None


def refuse_overwrite(folder: Path, planned_saves: Iterable[int]) -> None:
    """A run resumed from an older checkpoint must not save over a newer one of an earlier history."""
    taken = sorted(set(planned_saves) & set(complete_steps(folder)))
    if taken:
        raise CheckpointError(
            f"this run would save over the existing checkpoints {_describe(taken)} in {folder}; resume into a "
            "fresh folder with initial_load_path=, or move those checkpoints away"
        )
