"""A stop signal in your own loop: with ``ExactResume(..., stop_signals=...)`` and ``should_stop(step)``,
SIGTERM to the whole process group under torchrun (2 processes, 2 loader workers each) checkpoints every
rank at one agreed step, the loop ends cleanly, and the resumed run logs the uninterrupted run's losses,
bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from checks import assert_every_line_matches
from launch import REPO, run_env
from torchtitan_rng.checkpoint.layout import complete_steps

pytestmark = pytest.mark.e2e

STEPS, SIGNAL_AT = 6, 3
STOP = SIGNAL_AT + 1  # the ranks' vote on the signal is read one step later


def _torchrun(out: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(REPO / "tests" / "own_loop_stop.py"), str(out), *args]
    # A session of its own: the signal goes to this run's process group, not to pytest's.
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=run_env({"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}),
                          start_new_session=True)


def test_sigterm_to_the_group_checkpoints_and_resumes_exactly(tmp_path: Path) -> None:
    reference, run = tmp_path / "reference", tmp_path / "run"
    for out in (reference, run):
        out.mkdir()
    assert _torchrun(reference, str(STEPS)).returncode == 0

    _torchrun(run, str(STEPS), "--signal-at", str(SIGNAL_AT))  # torchrun itself reports the signal it got
    exits = sorted((run / "exits").read_text().splitlines())
    assert exits == [f"rank {rank} left the loop after step {STOP}" for rank in (0, 1)], exits
    assert complete_steps(run / "checkpoint") == [STOP]

    control = tmp_path / "control"
    control.mkdir()
    (control / "loss_log.jsonl").write_text((run / "loss_log.jsonl").read_text())
    (control / "checkpoint").mkdir()
    (run / "checkpoint" / f"step-{STOP}").rename(control / "checkpoint" / f"step-{STOP}")
    resumed = _torchrun(control, str(STEPS), "--no-restore")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (control / "checkpoint" / f"step-{STOP}").rename(run / "checkpoint" / f"step-{STOP}")

    resumed = _torchrun(run, str(STEPS))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_every_line_matches(reference, run)
    # Control: the same resume without restore_rng() (other dropout masks) is caught at its first step.
    with pytest.raises(AssertionError, match=f"step {STOP + 1}:"):
        assert_every_line_matches(reference, control)
