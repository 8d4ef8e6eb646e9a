"""Reading a run's tensor-fingerprint files (``tensor_fingerprints/rank{R}.jsonl``, see tensor_fingerprints.py).

Every field the locator reads is checked for the shape the recorder writes, so a damaged or crafted file is one
line naming the file, the line and the field (:class:`~torchtitan_rng.loss_log.LossLogError`), never a traceback
or a verdict about numbers nobody measured; fields the locator does not read pass as they are. A last line cut
by a kill counts as absent: the run's resume drops it, or never reopens the file (a resume over fewer ranks).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from torchtitan_rng.loss_log import LossLogError, is_int, read_lines

# Per step and rank: the line that rank wrote (the later one for a step written twice).
Steps = dict[int, dict[int, dict[str, Any]]]

_NAME = re.compile(r"rank(0|[1-9][0-9]*)\.jsonl")
_EXPECTED = "a JSON object with step, world_size and the recorder's hashes"


def _hashes(value: Any) -> bool:
    return isinstance(value, dict) and all(is_int(item) for item in value.values())


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(is_int(item) for item in value)


def _call(value: Any) -> bool:
    """``[name, input hashes, output hashes]``, then the hash of the stream a call drew from (or null)."""
    return (isinstance(value, list) and len(value) in (3, 4) and isinstance(value[0], str)
            and _int_list(value[1]) and _int_list(value[2]) and (len(value) == 3 or value[3] is None
                                                                   or is_int(value[3])))


def _check(rank: int) -> Callable[[dict[str, Any]], None]:
    def check(record: dict[str, Any]) -> None:
        if not is_int(record.get("step")):
            raise ValueError("no integer step")
        world_size = record.get("world_size")
        if not is_int(world_size) or world_size < 1:
            raise ValueError(f"world_size {world_size!r} is not a positive integer")
        if rank >= world_size:
            raise ValueError(f"world_size {world_size} has no rank {rank}")
        for key in ("grad", "param", "optim"):
            if key in record and not _hashes(record[key]):
                raise ValueError(f"{key} is not a table of hashes")
        entering = record.get("entering", {"param": {}, "optim": {}})
        if not (isinstance(entering, dict) and _hashes(entering.get("param")) and _hashes(entering.get("optim"))):
            raise ValueError("entering is not a table of param and optim hashes")
        batches = record.get("batch", [])
        if not (isinstance(batches, list) and all(isinstance(batch, dict) and all(map(_int_list, batch.values()))
                                                  for batch in batches)):
            raise ValueError("batch is not a list of hashes per micro-batch")
        if not _int_list(record.get("loss", [])):
            raise ValueError("loss is not a list of hashes per micro-batch")
        calls = record.get("modules", [])
        if not (isinstance(calls, list) and all(map(_call, calls))):
            raise ValueError("modules is not a list of [name, input hashes, output hashes, drawn]")
        sharded = record.get("sharded", [])
        if not (isinstance(sharded, list) and all(isinstance(name, str) for name in sharded)):
            raise ValueError("sharded is not a list of names")
    return check


def read_rank_files(folder: Path) -> tuple[Steps, set[str]] | None:
    """Per step and rank the later line written, and the names of sharded tensors; None without any file."""
    files = sorted(folder.glob("rank*.jsonl")) if folder.is_dir() else []
    if not files:
        return None
    steps: Steps = {}
    sharded: set[str] = set()
    for path in files:
        name = _NAME.fullmatch(path.name)
        if name is None:
            raise LossLogError(f"{path}: not a tensor-fingerprint file (the recorder writes rank0.jsonl, rank1.jsonl"
                               f", ...): move it out of {folder}")
        rank = int(name.group(1))
        for record in read_lines(path, "tensor-fingerprint", _EXPECTED, _check(rank), cut_line_absent=True):
            steps.setdefault(record["step"], {})[rank] = record
            sharded.update(record.get("sharded", []))
    return steps, sharded
