"""Which run a checkpoint folder belongs to: ``owner.json`` in it names the dump folder of that run.

Two runs saving into one checkpoint folder (an absolute folder or a URL prefix both name) save the same
``step-N`` at the same moment and write over each other's files: one of them once reported a checkpoint saved
that had no ``.metadata``. So a folder belongs to the first run that starts with it: the record is created
before the run's first save, exclusively (on a local folder with O_EXCL, on an object store by a conditional
write), and every other run is refused before it trains. The record is never deleted; handing a folder to
another dump folder (a run folder moved) replaces it.
"""

from __future__ import annotations

import json
from pathlib import Path

from torchtitan_rng.checkpoint.storage import Location
from torchtitan_rng.errors import CheckpointError

OWNER_NAME = "owner.json"


def _record(dump_folder: str) -> str:
    return json.dumps({"dump_folder": dump_folder}) + "\n"


def owner_of(folder: Location) -> str | None:
    """The dump folder of the run ``folder`` belongs to; None when no run claimed it yet."""
    entry = folder / OWNER_NAME
    if entry.kind() is None:
        return None
    try:
        owner = json.loads(entry.read_text())["dump_folder"]
    except (OSError, ValueError, TypeError, KeyError):
        owner = None
    if not isinstance(owner, str):
        raise CheckpointError(f"{entry} is not the owner record this trainer writes (a JSON object naming the "
                              "dump folder of the run the checkpoint folder belongs to): move it away, or give "
                              "this run its own --checkpoint.folder")
    return owner


def claim(folder: Location, dump_folder: str) -> str:
    """Make the run of ``dump_folder`` the owner of ``folder`` where no run is; returns the owner now (that
    run's dump folder, or another's)."""
    while not (folder / OWNER_NAME).create_text(_record(dump_folder)):
        owner = owner_of(folder)
        if owner is not None:
            return owner
    return dump_folder


def moves_with(folder: Location, dump_folder: str | Path) -> bool:
    """Whether ``folder`` lies inside the dump folder (copied or moved with it): that run's, whatever a record
    written before the move says."""
    return folder.local is not None and folder.local.resolve().is_relative_to(dump_folder)


def hand_over(folder: Location, dump_folder: str) -> None:
    """Make the run of ``dump_folder`` the owner of ``folder``, whoever owned it."""
    (folder / OWNER_NAME).write_text(_record(dump_folder))
