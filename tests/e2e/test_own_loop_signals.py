"""A stop signal in your own loop: with ``ExactResume(..., stop_signals=...)`` and ``should_stop(step)``,
SIGTERM to the whole process group under torchrun (2 processes, 2 loader workers each) checkpoints every
rank at one agreed step, the loop ends cleanly, and the resumed run logs the uninterrupted run's losses,
bit for bit."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checks import assert_every_line_matches
from tests.support.launch import REPO, run_env, together
from torchtitan_rng.checkpoint.layout import complete_steps


STEPS, SIGNAL_AT = 6, 3
STOP = SIGNAL_AT + 1  # the ranks' vote on the signal is read one step later


def _torchrun(out: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "tests.support.own_loop_stop", str(out), *args]
    # A session of its own: the signal goes to this run's process group, not to pytest's.
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=run_env(), start_new_session=True)


def test_sigterm_to_the_group_checkpoints_and_resumes_exactly(tmp_path: Path) -> None:
    reference, run, control = tmp_path / "reference", tmp_path / "run", tmp_path / "control"
    for out in (reference, run, control):
        out.mkdir()
    # The reference beside the signalled run (torchrun itself reports the signal it got).
    uninterrupted, _ = together(lambda: _torchrun(reference, str(STEPS)),
                                lambda: _torchrun(run, str(STEPS), "--signal-at", str(SIGNAL_AT)))
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    exits = sorted((run / "exits").read_text().splitlines())
    assert exits == [f"rank {rank} left the loop after step {STOP}" for rank in (0, 1)], exits
    assert complete_steps(run / "checkpoint") == [STOP]

    # The control, beside the resume: the same checkpoint resumed without restore_rng().
    (control / "loss_log.jsonl").write_text((run / "loss_log.jsonl").read_text())
    shutil.copytree(run / "checkpoint" / f"step-{STOP}", control / "checkpoint" / f"step-{STOP}")
    for resumed in together(lambda: _torchrun(run, str(STEPS)),
                            lambda: _torchrun(control, str(STEPS), "--no-restore")):
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_every_line_matches(reference, run)
    # Control: the same resume without restore_rng() (other dropout masks) is caught at its first step.
    with pytest.raises(AssertionError, match=f"step {STOP + 1}:"):
        assert_every_line_matches(reference, control)
