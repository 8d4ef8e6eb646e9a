"""The loss log: ``{dump_folder}/loss_log.jsonl``, one JSON object per step, written by rank 0.

Python's float repr is the shortest string that reads back to the same double, so ``json`` round-trips
a float32 loss (exactly representable as a double) bit for bit. A resumed run appends; when a step
appears twice (a run redone after a crash), the later line counts.

Records may hold 0-d device tensors: the writer keeps them until :meth:`LossLogWriter.flush`, which reads
them all in one device-to-host copy, so a step costs no host synchronisation. A bool tensor is a flag (the
spike guard's ``"skipped"``): written as ``true`` when set, left out when not, as a host ``True`` would be.
The trainer flushes before every checkpoint, so a run killed between two flushes loses only steps after its
last checkpoint, which the resume recomputes; a run that fails with an error writes its queued steps when the
writer is closed.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path
from typing import Any, Callable, Iterator

from torchtitan_rng.errors import TorchtitanRngError, disk_full

LOSS_LOG_NAME = "loss_log.jsonl"


class LossLogError(TorchtitanRngError, ValueError):
    """A loss log that cannot be read or written; the message names the file (and line) and why."""


def same_bits(a: float, b: float) -> bool:
    """Whether two logged values are the same float64, bit for bit."""
    return struct.pack("<d", float(a)) == struct.pack("<d", float(b))


def _drop_cut_line(path: Path) -> None:
    """Remove a last line without its newline: a write cut by a kill or a full disk. Its steps come after
    the last checkpoint (the log is written before every save), so the resume writes them again."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with path.open("rb+") as file:
        end = file.seek(-1, os.SEEK_END)
        if file.read(1) == b"\n":
            return
        while end > 0:  # back to the last newline, a block at a time (the log may be long)
            start = max(0, end - 2**16)
            file.seek(start)
            newline = file.read(end - start).rfind(b"\n")
            if newline >= 0:
                file.truncate(start + newline + 1)
                return
            end = start
        file.truncate(0)  # a single line, cut


def loss_log_path(dump_folder: str | Path) -> Path:
    return Path(dump_folder) / LOSS_LOG_NAME


class LossLogWriter:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _drop_cut_line(path)
        self.path = path
        # Unbuffered: a write the disk refused leaves nothing behind in a buffer to fail again at close.
        self.file = path.open("ab", buffering=0)
        self.pending: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        """Queue a step's record; nothing is read from the device until :meth:`flush`."""
        self.pending.append(record)

    def flush(self) -> list[dict[str, Any]]:
        """Write the queued records (fsynced) and return them as written."""
        if not self.pending:
            return []
        import torch  # here, not at the top: compare_losses reads logs without paying torch's import

        tensors = [value for record in self.pending for value in record.values() if isinstance(value, torch.Tensor)]
        # float64 holds every float32/bf16 value exactly: the same number float(tensor) gives.
        values = iter(torch.stack([t.detach().reshape(()).to(torch.float64) for t in tensors]).tolist()
                      if tensors else [])
        written = [{key: next(values) if isinstance(value, torch.Tensor) else value for key, value in record.items()}
                   for record in self.pending]
        for record, queued in zip(written, self.pending):
            for key in [key for key, value in queued.items()
                        if isinstance(value, torch.Tensor) and value.dtype == torch.bool]:
                if record[key]:
                    record[key] = True
                else:
                    del record[key]
        self.pending = []
        self._append("".join(json.dumps(record) + "\n" for record in written))
        return written

    def _append(self, lines: str) -> None:
        """Append whole lines, fsynced; a full disk is one line saying what to do."""
        data = memoryview(lines.encode())
        try:
            while data:
                data = data[self.file.write(data) :]
            os.fsync(self.file.fileno())
        except OSError as err:
            if disk_full(err) is None:
                raise
            raise LossLogError(f"{self.path}: the disk is full ({err.strerror}); free space and run the same "
                               "command again: it resumes from the last checkpoint and writes these steps "
                               "again") from None

    def close(self) -> None:
        """Write what is still queued, then close: a run that fails between two sync points (a NaN, an
        error in step N) keeps the losses of its last steps."""
        try:
            self.flush()
        finally:
            self.file.close()


def _shown(text: str) -> str:
    return text if len(text) <= 20 else text[:20] + "..."


def _number_in_range(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # a literal past float range; the writer writes an infinite loss as Infinity
        raise ValueError(f"the number {_shown(text)} is out of float range")
    return value


def _int_in_range(text: str) -> int:
    # The widest integers the writers write are 64-bit hashes; checking the digits first spares int() a huge one.
    if len(text.lstrip("-")) > 20 or not -2**64 < int(text) < 2**64:
        raise ValueError(f"the number {_shown(text)} is out of range")
    return int(text)


def _kind(path: Path) -> str:
    try:
        mode = path.stat().st_mode
    except OSError as err:  # a broken link, a link loop, no permission
        return f"unreadable ({err.strerror})"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def read_lines(path: Path, what: str, expected: str, check: Callable[[dict[str, Any]], None], *,
               cut_line_absent: bool = False) -> Iterator[dict[str, Any]]:
    """The records of a JSON-lines file as :class:`LossLogWriter` writes them, each passed through ``check``
    (which raises ValueError saying what is wrong). Anything else is one LossLogError naming the file (and line):
    a path that is not a regular file (a FIFO or a device would never end), a byte that is not UTF-8, a number
    out of range, nesting too deep to read, a record ``check`` refuses. ``cut_line_absent``: a last line without
    its newline that does not read (a write cut by a kill, which the writer drops when the run goes on) counts as
    absent."""
    if not path.is_file():
        raise LossLogError(f"{path} is {_kind(path)}, not a {what} file: move it away (the trainer writes a "
                           "regular file there)")
    lines = path.read_bytes().split(b"\n")
    cut = lines.pop()  # b"" after a final newline; else a last line without its newline
    numbered = [(number, line, False) for number, line in enumerate(lines, start=1)]
    if cut:
        numbered.append((len(lines) + 1, cut, True))
    for number, line, is_cut in numbered:
        if not line.strip():
            continue
        try:
            try:
                record = json.loads(line.decode("utf-8"), parse_float=_number_in_range, parse_int=_int_in_range)
            except UnicodeDecodeError:
                raise ValueError("a byte that is not UTF-8 text") from None
            except RecursionError:
                raise ValueError("nested too deep") from None
            except json.JSONDecodeError:
                raise ValueError("not JSON") from None
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
            check(record)
        except ValueError as err:
            if is_cut and cut_line_absent:
                continue
            raise LossLogError(f"{path}:{number}: not a {what} line ({err}; expected {expected})") from None
        yield record


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_loss_line(record: dict[str, Any]) -> None:
    if not is_int(record.get("step")):
        raise ValueError("no integer step")
    if not isinstance(record.get("loss"), (int, float)) or isinstance(record["loss"], bool):
        raise ValueError("no numeric loss")
    prints = record.get("rng_fingerprint")
    if prints is not None and not (isinstance(prints, list) and all(
            isinstance(rank, dict) and all(isinstance(value, str) for value in rank.values()) for rank in prints)):
        raise ValueError("rng_fingerprint is not a list of hashes per rank")


def read_loss_log(run: Path) -> dict[int, dict[str, Any]]:
    """Records by step of a loss log given as its file or the dump folder holding it; the later line wins for a
    step written twice."""
    path = loss_log_path(run) if run.is_dir() else run
    if not path.exists() and not path.is_symlink():
        raise LossLogError(f"{path}: no such loss log (give a loss_log.jsonl or the dump folder holding one)")
    return read_loss_log_file(path)


def read_loss_log_file(path: Path, *, cut_line_absent: bool = False) -> dict[int, dict[str, Any]]:
    """Records by step; ``cut_line_absent``: see :func:`read_lines` (a run going on drops that line, a
    comparison names it)."""
    return {record["step"]: record
            for record in read_lines(path, "loss-log", "a JSON object with step and loss", _check_loss_line,
                                     cut_line_absent=cut_line_absent)}
