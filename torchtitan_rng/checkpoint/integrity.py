"""Checksums of a checkpoint's files: written at save, verified at load, so damage is refused, not trained on.

Rank 0 writes ``checksums.json`` into ``step-N.partial`` once every rank's files and DCP's ``.metadata`` are
there, before the rename: for every file its size and a 128-bit sum. The sum is Fletcher-style over
little-endian 64-bit words, computed with NumPy at memory speed: ``s1`` is the sum of the words, ``s2`` the
sum of each 32 KiB block's sum weighted by its position (mod 2**64). Any single flipped bit changes
``s1``; a truncated or extended file changes the size; blocks moved within a file change ``s2``. It finds
damage (disk, copy, transfer), not tampering: whoever can edit a shard can edit this file too. zlib's
crc32 ran at about 1 GB/s here, which would have made a save about 1.4x slower; this sums a memory-mapped
file at ~20 GB/s (on an object store, the file as it streams back from the store).

Tampering: with a signing key (:func:`signing_key`, from an environment variable the user names), rank 0
also writes ``signature.json``, an HMAC-SHA256 of ``checksums.json`` under that key. A resume with the key
checks it before anything else is read (:func:`verify_signature`): whoever changes a file and rewrites
``checksums.json`` without the key is refused, naming the file.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from typing import Iterable, NoReturn

import numpy as np

from torchtitan_rng.checkpoint.layout import CHECKSUMS_NAME, MARKER_NAME, SIGNATURE_NAME
from torchtitan_rng.checkpoint.storage import Location, Where, locate
from torchtitan_rng.errors import CheckpointError

# Set by the launcher for the ranks: the checkpoint whose files it verified before starting them.
VERIFIED_ENV = "TORCHTITAN_RNG_VERIFIED_CHECKPOINT"
BLOCK_BYTES = 32 * 1024
_WORDS_PER_BLOCK = BLOCK_BYTES // 8
_MASK = (1 << 64) - 1
# Written after the checksums, so not covered by them: the signature of checksums.json, the completion marker.
_UNSUMMED = {CHECKSUMS_NAME, SIGNATURE_NAME, MARKER_NAME}


def file_sum(path: Where) -> str:
    """The 128-bit Fletcher-style sum of a file as 32 hex digits (see the module's docstring), over the
    buffers its storage hands out (a local file: memory-mapped, summed in place with no copy)."""
    block_sums: list[np.ndarray] = []
    rest = b""  # the last, partial block's bytes (only the last buffer has them)
    for chunk in locate(path).chunks():
        whole = len(chunk) - len(chunk) % BLOCK_BYTES
        words = np.frombuffer(chunk, dtype="<u8", count=whole // 8)
        block_sums.append(words.reshape(-1, _WORDS_PER_BLOCK).sum(axis=1, dtype=np.uint64))
        del words  # no view of a mapping may outlive it
        rest = bytes(chunk[whole:])
    blocks = np.concatenate(block_sums) if block_sums else np.zeros(0, dtype=np.uint64)
    if rest:  # a last, partial block; the file's last bytes zero-padded to a word (size is recorded)
        full = len(rest) - len(rest) % 8
        last = int(np.frombuffer(rest, dtype="<u8", count=full // 8).sum(dtype=np.uint64))
        last += int.from_bytes(rest[full:].ljust(8, b"\0"), "little") if rest[full:] else 0
        blocks = np.append(blocks, np.uint64(last & _MASK))
    if not len(blocks):
        return "0" * 32
    # uint64 array arithmetic wraps mod 2**64 (silently, unlike NumPy scalars).
    s1 = int(blocks.sum(dtype=np.uint64))
    s2 = int(np.dot(blocks, np.arange(1, len(blocks) + 1, dtype=np.uint64)))
    return f"{s1:016x}{s2:016x}"


@dataclass(frozen=True)
class SigningKey:
    """A key for :func:`write_checksums` and :func:`verify_signature`, and the variable it came from."""

    env: str
    key: bytes


def signing_key(env: str) -> SigningKey | None:
    """The key in environment variable ``env`` ("": no signing); a named variable that is unset or empty is
    refused, so a missing key never means an unsigned save or an unchecked load."""
    if not env:
        return None
    value = os.environ.get(env, "")
    if not value:
        raise CheckpointError(f"checkpoints are signed with the key in ${env}, but ${env} is not set in this "
                              "process's environment: set it (the same key as at save) in every process")
    return SigningKey(env, value.encode())


def _hmac(key: SigningKey, checksums: bytes) -> str:
    return hmac.new(key.key, checksums, hashlib.sha256).hexdigest()


def write_checksums(folder: Where, key: SigningKey | None = None) -> None:
    """Record every file of a finished checkpoint folder (call it after the last file is written); with a
    key, sign the record."""
    folder = locate(folder)
    sums = {name: {"bytes": (folder / name).size(), "sum": file_sum(folder / name)}
            for name in folder.files() if name not in _UNSUMMED}
    record = (json.dumps(sums, indent=1, sort_keys=True) + "\n").encode()
    (folder / CHECKSUMS_NAME).write_bytes(record)
    if key is not None:
        (folder / SIGNATURE_NAME).write_text(json.dumps({"algorithm": "hmac-sha256", "key_env": key.env,
                                                         "hmac": _hmac(key, record)}, indent=1) + "\n")


def verify_signature(folder: Where, key: SigningKey | None) -> list[str]:
    """With a key: CheckpointError unless ``checksums.json`` carries this key's signature. Without one:
    a note when the checkpoint is signed all the same (it cannot be checked here). Reads two small files."""
    folder = locate(folder)
    signature = folder / SIGNATURE_NAME
    if key is None:
        return ([f"note: checkpoint {folder} is signed, and no signing key was given: its signature is not "
                 "checked"] if signature.is_file() else [])
    checksums = folder / CHECKSUMS_NAME
    if not checksums.is_file():
        _refuse(folder, f"it has no {CHECKSUMS_NAME}, so nothing in it is signed")
    if not signature.is_file():
        _refuse(folder, f"it has no {SIGNATURE_NAME} (saved unsigned, or the signature was removed)")
    try:
        expected = str(json.loads(signature.read_text())["hmac"])
    except (OSError, ValueError, TypeError, KeyError):
        _refuse(folder, f"{SIGNATURE_NAME} is not the JSON written at save")
    if not hmac.compare_digest(_hmac(key, checksums.read_bytes()), expected):
        _refuse(folder, f"{CHECKSUMS_NAME} does not match its signature under the key in ${key.env} (changed "
                        "after the save, or signed with another key)")
    return []


def _refuse(folder: Location, why: str) -> NoReturn:
    raise CheckpointError(f"checkpoint {folder} is refused: {why}; it may have been tampered with: resume from "
                          "a checkpoint signed with this key (load_step=), or check the key")


def verify_integrity(folder: Where) -> bool:
    """True when every recorded file is there unchanged; False when the checkpoint has no checksums (saved
    by an older version); CheckpointError naming the first file that differs. Reads every byte: call it
    once per resume, on one process."""
    return verify_files(folder)


# What a resume says to do with a damaged checkpoint. Not "pick another with load_step=": resumed from an older
# one, the run would save over the damaged one and is refused for it.
RESUME_ADVICE = ("move it out of the folder (a resume then picks the newest checkpoint before it), or restore it from "
                 "a copy")
# What a tool that reads a checkpoint without loading it says to do with a damaged one (no load_step= there).
TOOL_ADVICE = "restore it from a copy, or move it away and pick another step"


def verify_files(folder: Where, names: Iterable[str] | None = None,
                 advice: str = RESUME_ADVICE) -> bool:
    """:func:`verify_integrity` of the files ``names`` only (None: every recorded file), for a reader that
    reads just those (``run.json``, ``.metadata``): a named file the checksums do not list is damage too, as a
    save lists every file it writes. ``advice``: what the refusal says to do."""
    folder = locate(folder)
    record = folder / CHECKSUMS_NAME
    if not record.is_file():
        return False
    try:
        sums = json.loads(record.read_text())
        expected = {name: (int(entry["bytes"]), str(entry["sum"])) for name, entry in sums.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        _damaged(folder, f"{CHECKSUMS_NAME} is damaged (not the JSON written at save)", advice)
    for name in sorted(expected if names is None else set(names)):
        path = folder / name
        if name not in expected:
            if path.is_file():
                _damaged(folder, f"{name} is not in its {CHECKSUMS_NAME} (added after the save)", advice)
            continue  # neither written nor recorded: the reader says what is missing
        size, digest = expected[name]
        if not path.is_file():
            _damaged(folder, f"{name} is missing", advice)
        actual = path.size()
        if actual != size:
            _damaged(folder, f"{name} has {actual} bytes, {size} were written", advice)
        if file_sum(path) != digest:
            _damaged(folder, f"{name} does not match the checksum written at save (its content changed)", advice)
    return True


def _damaged(folder: Location, what: str, advice: str) -> NoReturn:
    raise CheckpointError(f"checkpoint {folder} is damaged: {what}; {advice}")
