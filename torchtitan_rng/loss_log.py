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
import os
from pathlib import Path
from typing import Any

from torchtitan_rng.errors import TorchtitanRngError, disk_full

LOSS_LOG_NAME = "loss_log.jsonl"


class LossLogError(TorchtitanRngError, ValueError):
    """A loss log that cannot be read or written; the message names the file (and line) and why."""


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


def read_loss_log(path: Path) -> dict[int, dict[str, Any]]:
    """Records by step; the later line wins for a step written twice."""
    if path.is_dir():
        path = loss_log_path(path)
    if not path.is_file():
        raise LossLogError(f"{path}: no such loss log (give a loss_log.jsonl or the dump folder holding one)")
    records: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
            float(record["loss"])
        except (ValueError, KeyError, TypeError):
            raise LossLogError(
                f"{path}:{number}: not a loss-log line (expected a JSON object with step and loss)"
            ) from None
        records[step] = record
    return records
