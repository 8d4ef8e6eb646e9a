"""The loss log: ``{dump_folder}/loss_log.jsonl``, one JSON object per step, written by rank 0.

Python's float repr is the shortest string that reads back to the same double, so ``json`` round-trips
a float32 loss (exactly representable as a double) bit for bit. A resumed run appends; when a step
appears twice (a run redone after a crash), the later line counts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

LOSS_LOG_NAME = "loss_log.jsonl"


class LossLogError(ValueError):
    """A loss log that cannot be read; the message names the file and line."""


def loss_log_path(dump_folder: str | Path) -> Path:
    return Path(dump_folder) / LOSS_LOG_NAME


class LossLogWriter:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        # Flushed to the OS at every step so that a killed run leaves every finished step in the log.
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
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
