"""Checksums of a checkpoint's files: written at save, verified at load, so damage is refused, not trained on.

Rank 0 writes ``checksums.json`` into ``step-N.partial`` once every rank's files and DCP's ``.metadata`` are
there, before the rename: for every file its size and a 128-bit sum. The sum is Fletcher-style over
little-endian 64-bit words, computed with NumPy at memory speed: ``s1`` is the sum of the words, ``s2`` the
sum of each 32 KiB block's sum weighted by its position (mod 2**64). Any single flipped bit changes
``s1``; a truncated or extended file changes the size; blocks moved within a file change ``s2``. It finds
damage (disk, copy, transfer), not tampering: whoever can edit a shard can edit this file too. zlib's
crc32 ran at about 1 GB/s here, which would have made a save about 1.4x slower; this sums a memory-mapped
file at ~20 GB/s.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path
from typing import NoReturn

import numpy as np

from torchtitan_rng.errors import CheckpointError

CHECKSUMS_NAME = "checksums.json"
# Set by the launcher for the ranks: the checkpoint whose files it verified before starting them.
VERIFIED_ENV = "TORCHTITAN_RNG_VERIFIED_CHECKPOINT"
_WORDS_PER_BLOCK = 4096  # 32 KiB
_MASK = (1 << 64) - 1


def file_sum(path: Path) -> str:
    """The 128-bit Fletcher-style sum of a file as 32 hex digits (see the module's docstring). The file is
    memory-mapped: NumPy sums the page cache in place, with no copy."""
    size = path.stat().st_size
    if size == 0:
        return "0" * 32
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        words = np.frombuffer(mapped, dtype="<u8", count=size // 8)
        whole = len(words) - len(words) % _WORDS_PER_BLOCK
        blocks = words[:whole].reshape(-1, _WORDS_PER_BLOCK).sum(axis=1, dtype=np.uint64)
        last = int(words[whole:].sum(dtype=np.uint64))
        del words  # no view of the mapping may outlive it
        tail = bytes(mapped[size - size % 8 :])
    if whole * 8 < size:  # a last, partial block; the file's last bytes zero-padded to a word (size is recorded)
        last += int.from_bytes(tail.ljust(8, b"\0"), "little") if tail else 0
        blocks = np.append(blocks, np.uint64(last & _MASK))
    # uint64 array arithmetic wraps mod 2**64 (silently, unlike NumPy scalars).
    s1 = int(blocks.sum(dtype=np.uint64))
    s2 = int(np.dot(blocks, np.arange(1, len(blocks) + 1, dtype=np.uint64)))
    return f"{s1:016x}{s2:016x}"


def _files(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*") if path.is_file() and path.name != CHECKSUMS_NAME)


def write_checksums(folder: Path) -> None:
    """Record every file of a finished checkpoint folder (call it after the last file is written)."""
    sums = {path.relative_to(folder).as_posix(): {"bytes": path.stat().st_size, "sum": file_sum(path)}
            for path in _files(folder)}
    (folder / CHECKSUMS_NAME).write_text(json.dumps(sums, indent=1, sort_keys=True) + "\n")


def verify_integrity(folder: Path) -> bool:
    """True when every recorded file is there unchanged; False when the checkpoint has no checksums (saved
    by an older version); CheckpointError naming the first file that differs. Reads every byte: call it
    once per resume, on one process."""
    record = folder / CHECKSUMS_NAME
    if not record.is_file():
        return False
    try:
        sums = json.loads(record.read_text())
        expected = {name: (int(entry["bytes"]), str(entry["sum"])) for name, entry in sums.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        _damaged(folder, f"{CHECKSUMS_NAME} is damaged (not the JSON written at save)")
    for name, (size, digest) in sorted(expected.items()):
        path = folder / name
        if not path.is_file():
            _damaged(folder, f"{name} is missing")
        actual = path.stat().st_size
        if actual != size:
            _damaged(folder, f"{name} has {actual} bytes, {size} were written")
        if file_sum(path) != digest:
            _damaged(folder, f"{name} does not match the checksum written at save (its content changed)")
    return True


def _damaged(folder: Path, what: str) -> NoReturn:
    raise CheckpointError(f"checkpoint {folder} is damaged: {what}; pick another with load_step= "
                          "(or move it away)")
