"""Helpers shared by the test files: loss logs compared bit for bit, one-line refusals, checkpoint edits."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from torchtitan_rng.loss_log import read_loss_log


def float_bits(value: float) -> bytes:
    """The IEEE-754 double's bytes: tells -0.0 from 0.0, and equates a NaN with itself (``==`` does neither)."""
    return struct.pack("<d", float(value))


def assert_every_line_matches(reference: Path, resumed: Path) -> None:
    """Every line ever written to ``resumed``'s loss log (a step redone after a stop or a kill appears
    more than once) has the loss, bit for bit, that ``reference`` logged for that step."""
    expected = read_loss_log(reference)
    lines = (resumed / "loss_log.jsonl").read_text().splitlines()
    assert lines, f"{resumed} logged nothing"
    for line in lines:
        record = json.loads(line)
        want = expected[record["step"]]["loss"]
        assert float_bits(record["loss"]) == float_bits(want), f"step {record['step']}: {record['loss']!r} != {want!r}"


def snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder under ``folder`` with a hash of its content."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        for path in sorted(folder.rglob("*"))
    }


def assert_clean_exit(proc: subprocess.CompletedProcess) -> None:
    """Exit 0 and no traceback anywhere in the output."""
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stdout + proc.stderr


def assert_refused(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 2, exactly one line on stderr starting with ``error:``, holding every fragment; no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def load_checkpoint(ckpt: Path, staged: Path) -> dict[str, Any]:
    """A real DCP checkpoint's whole state, in this process (through the torch.save file ``staged``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(ckpt, staged)  # a test's own checkpoint: trusted
        return torch.load(staged, weights_only=False)


def rewrite_checkpoint(ckpt: Path, tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Load a real DCP checkpoint, edit its state, write it back as a real DCP checkpoint."""
    state = load_checkpoint(ckpt, tmp_path / "staged.pt")
    edit(state)
    shutil.rmtree(ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(ckpt))


def assert_same_tensors(a: Any, b: Any, where: str = "") -> None:
    """Equal structure, equal values, every tensor equal byte for byte (checkpoint contents)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for key in a:
            assert_same_tensors(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, f"{where}: tensor kinds differ"
        assert a.numpy().tobytes() == b.numpy().tobytes(), f"{where}: tensor bits differ"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
