"""Launch-side input that starts a run: a run started from another directory writes where the caller pointed it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.launch import REPO, run_env


def test_relative_dump_folder_means_the_callers_directory(tmp_path: Path) -> None:
    caller = tmp_path / "caller"
    caller.mkdir()
    proc = subprocess.run(["bash", str(REPO / "run_train.sh"), "--job.dump_folder", "rel", "--training.steps", "2"],
                          cwd=caller, capture_output=True, text=True, timeout=300,
                          env=run_env({"PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((caller / "rel" / "loss_log.jsonl").read_text().splitlines()) == 2
    assert not (REPO / "rel").exists()
