"""The shared "every logged line matches" check compares float bits: it catches what ``==`` misses."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checks import assert_every_line_matches
from tests.support.launch import REPO, run_env


def _log(folder: Path, *losses: float) -> Path:
    folder.mkdir()
    lines = [json.dumps({"step": step, "loss": loss}) for step, loss in enumerate(losses, start=1)]
    (folder / "loss_log.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_identical_logs_match_nan_included(tmp_path: Path) -> None:
    # A NaN loss logged the same way twice is the same result; == would call it a difference.
    assert_every_line_matches(_log(tmp_path / "a", 2.5, math.nan), _log(tmp_path / "b", 2.5, math.nan))


@pytest.mark.parametrize(("a", "b"), [(0.0, -0.0), (2.5, math.nextafter(2.5, 3.0))])
def test_a_one_bit_difference_is_caught(tmp_path: Path, a: float, b: float) -> None:
    # -0.0 == 0.0 in Python: a comparison with == would let this pass.
    with pytest.raises(AssertionError, match="step 2"):
        assert_every_line_matches(_log(tmp_path / "a", 1.0, a), _log(tmp_path / "b", 1.0, b))


def test_a_redone_step_is_checked_on_every_line(tmp_path: Path) -> None:
    reference = _log(tmp_path / "a", 1.0, 2.0)
    resumed = _log(tmp_path / "b", 1.0, 2.0)
    with (resumed / "loss_log.jsonl").open("a") as log:  # step 2 redone after a kill, with another loss
        log.write(json.dumps({"step": 2, "loss": 2.0000001}) + "\n")
    with pytest.raises(AssertionError, match="step 2"):
        assert_every_line_matches(reference, resumed)


def test_the_compare_command_does_not_import_torch() -> None:
    """Reading two logs needs no torch: the command answers in a fraction of torch's import time."""
    code = "import sys, torchtitan_rng.compare_losses; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=run_env())
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stdout + proc.stderr
