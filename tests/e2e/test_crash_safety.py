"""Crash safety: SIGKILL at any moment, a save included, never leaves a folder that is later picked as the
newest complete checkpoint, and every resume continues the uninterrupted loss curve bit for bit.

The kills come from fault_injection.py (a rank SIGKILLs itself at a named point), so each one happens at
exactly the moment the test names, with no timing guesswork.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support.checks import assert_every_line_matches, float_bits
from tests.support.launch import compare, together, train
from torchtitan_rng.checkpoint.layout import complete_steps
from torchtitan_rng.checkpoint.owner import OWNER_NAME
from torchtitan_rng.fault_injection import ENV_VAR as FAULT_ENV
from torchtitan_rng.loss_log import read_loss_log


COMMON = ("--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "2")

# (fault, checkpoint the run resumes from or None, complete checkpoints after the kill, other folders left)
KILLS = [
    ("before_step:3", None, [], []),                              # no checkpoint yet
    ("save_writing:10", None, [5], ["step-10.partial"]),          # DCP half-way through the shard file
    ("save_written:10", 5, [5], ["step-10.partial"]),             # all written, .metadata too, not renamed
    ("save_renamed:10", 5, [5, 10], []),                          # renamed, old ones not pruned yet
    ("before_step:13", 10, [5, 10], []),                          # in the middle of the run
    ("prune:15", 10, [10, 15], ["step-5.deleting"]),              # pruning step-5 after saving step-15
]


def _folders(dump: Path) -> list[str]:
    """The checkpoint folder's entries but the run's owner record (written at its start)."""
    folder = dump / "checkpoint"
    return sorted(entry.name for entry in folder.iterdir() if entry.name != OWNER_NAME) if folder.is_dir() else []


@pytest.fixture(scope="module")
def uninterrupted(llama_uninterrupted: Path) -> Path:
    return llama_uninterrupted


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One dump folder, killed at every moment of KILLS in turn (each run resuming the previous), then
    run to the end. Records each run's output and the checkpoint folder after it."""
    dump = tmp_path_factory.mktemp("B")
    runs: list[tuple[subprocess.CompletedProcess, list[str], list[int]]] = []
    for fault, *_ in KILLS:
        run = train(dump, *COMMON, env={FAULT_ENV: fault}, check=False)
        runs.append((run, _folders(dump), complete_steps(dump / "checkpoint")))
    final = train(dump, *COMMON)
    return {"dump": dump, "runs": runs, "final": final}


@pytest.mark.parametrize("index", range(len(KILLS)), ids=[fault for fault, *_ in KILLS])
def test_kill_leaves_only_complete_checkpoints(killed_and_resumed: dict, index: int) -> None:
    fault, resumed_from, complete, others = KILLS[index]
    run, folders, picked_as_complete = killed_and_resumed["runs"][index]
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    if resumed_from is None:
        assert "resumed from" not in run.stdout
    else:
        picked = killed_and_resumed["dump"] / "checkpoint" / f"step-{resumed_from}"
        assert f"resumed from {picked} at step" in run.stdout
    assert folders == sorted([*(f"step-{s}" for s in complete), *others])
    assert picked_as_complete == complete


def test_final_resume_cleans_up_and_finishes(killed_and_resumed: dict) -> None:
    assert "checkpoint/step-15 at step 15" in killed_and_resumed["final"].stdout
    assert _folders(killed_and_resumed["dump"]) == ["step-15", "step-20"]  # leftovers of the kills are gone


def test_every_resume_matches_uninterrupted(uninterrupted: Path, killed_and_resumed: dict) -> None:
    """compare_losses counts a step's last line; here every line ever written must match as well, so a
    run that diverged and was then killed and redone cannot hide."""
    result = compare(uninterrupted, killed_and_resumed["dump"])
    assert result.returncode == 0, result.stdout
    lines = (killed_and_resumed["dump"] / "loss_log.jsonl").read_text().splitlines()
    assert len(lines) > 20  # steps redone after the kills are in the log twice
    assert_every_line_matches(uninterrupted, killed_and_resumed["dump"])


def test_control_resume_without_rng_differs(uninterrupted: Path, killed_and_resumed: dict, tmp_path: Path) -> None:
    """The check above can fail: resuming the same step-15 without its random streams diverges at once."""
    shutil.copytree(killed_and_resumed["dump"] / "checkpoint" / "step-15", tmp_path / "checkpoint" / "step-15")
    train(tmp_path, "--checkpoint.enable", "--checkpoint.restore_rng", "false", "--training.steps", "16",
          "--lr_scheduler.total_steps", "20")
    result = compare(uninterrupted, tmp_path, "--only-common-steps")
    assert result.returncode == 1 and result.stdout.startswith("first differing step 16:"), result.stdout


def test_kill_between_two_log_flushes_loses_only_what_the_resume_redoes(tmp_path: Path) -> None:
    """With metrics.log_freq 4 and a checkpoint every 3 steps the log is written at steps 3, 4, 6 and 8.
    SIGKILL before step 6 loses step 5 (finished, not yet written); the resume from step 3 writes it again,
    with the bits of a run that wrote every step as it finished."""
    run = ("--training.steps", "8", "--lr_scheduler.total_steps", "8", "--checkpoint.enable",
           "--checkpoint.interval", "3")
    _, killed = together(
        lambda: train(tmp_path / "A", *run, "--metrics.log_freq", "1"),
        lambda: train(tmp_path / "B", *run, "--metrics.log_freq", "4", env={FAULT_ENV: "before_step:6"}, check=False))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    # Control: the kill did fall between two writes, so step 5 was really lost.
    assert sorted(read_loss_log(tmp_path / "B")) == [1, 2, 3, 4]
    assert complete_steps(tmp_path / "B" / "checkpoint") == [3]
    train(tmp_path / "B", *run, "--metrics.log_freq", "4")
    assert sorted(read_loss_log(tmp_path / "B")) == list(range(1, 9))
    assert_every_line_matches(tmp_path / "A", tmp_path / "B")
    reference, resumed = read_loss_log(tmp_path / "A"), read_loss_log(tmp_path / "B")
    assert all(float_bits(resumed[step]["grad_norm"]) == float_bits(reference[step]["grad_norm"]) for step in reference)


@pytest.mark.usefixtures("sigint_raises_in_children")
def test_an_error_between_two_log_flushes_keeps_the_queued_steps(tmp_path: Path) -> None:
    """A run that fails with a Python error (here an interrupt before step 6) still writes the steps it
    finished since the last write, with their bits; the SIGKILL test above is the control (step 5 lost). SIGINT is
    taken off the stop signals here, so that it raises KeyboardInterrupt as in any Python program."""
    run = ("--training.steps", "8", "--lr_scheduler.total_steps", "8", "--metrics.log_freq", "4")
    failed, _ = together(
        lambda: train(tmp_path / "B", *run, "--signals.checkpoint_on", "SIGTERM,SIGUSR1",
                      env={FAULT_ENV: "before_step:6:0:SIGINT"}, check=False),
        lambda: train(tmp_path / "A", *run[:4], "--metrics.log_freq", "1"))
    assert failed.returncode != 0
    assert sorted(read_loss_log(tmp_path / "B")) == [1, 2, 3, 4, 5]
    reference, failed_log = read_loss_log(tmp_path / "A"), read_loss_log(tmp_path / "B")
    assert all(float_bits(failed_log[step]["loss"]) == float_bits(reference[step]["loss"]) for step in failed_log)
