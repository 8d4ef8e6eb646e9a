"""The promise for the LLM trainer: a stopped-and-resumed run writes the same loss log, bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.launch import compare, stop_and_resume, together, train
from torchtitan_rng.checkpoint.owner import OWNER_NAME
from torchtitan_rng.loss_log import read_loss_log


@pytest.fixture(scope="module")
def uninterrupted(llama_uninterrupted: Path) -> Path:
    return llama_uninterrupted


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Stopped at 10 and resumed to 20, on 1 and on 2 processes side by side; then from the 1-process run's
    checkpoints, side by side: step 5 into a fresh folder, and step 10 without the RNG restore (the control)."""
    folder = tmp_path_factory.mktemp("llama_B")
    dumps = {name: folder / name for name in ("one_process", "two_processes", "older", "without_rng")}
    together(lambda: stop_and_resume(dumps["one_process"], stop_at=10, total=20),
             lambda: stop_and_resume(dumps["two_processes"], stop_at=10, total=20, nproc=2))
    shutil.copytree(dumps["one_process"] / "checkpoint" / "step-10", dumps["without_rng"] / "checkpoint" / "step-10")
    together(lambda: train(dumps["older"], "--checkpoint.enable", "--checkpoint.initial_load_path",
                           str(dumps["one_process"] / "checkpoint"), "--checkpoint.load_step", "5",
                           "--lr_scheduler.total_steps", "20"),
             lambda: train(dumps["without_rng"], "--checkpoint.enable", "--lr_scheduler.total_steps", "20",
                           "--checkpoint.restore_rng", "false"))
    return dumps


@pytest.fixture(scope="module")
def stopped_and_resumed(runs: dict[str, Path]) -> Path:
    return runs["one_process"]


def test_resumed_log_equals_uninterrupted(uninterrupted: Path, stopped_and_resumed: Path) -> None:
    result = compare(uninterrupted, stopped_and_resumed)
    assert result.returncode == 0, result.stdout
    assert sorted(read_loss_log(stopped_and_resumed)) == list(range(1, 21))
    steps = sorted(p.name for p in (stopped_and_resumed / "checkpoint").iterdir() if p.name != OWNER_NAME)
    assert steps == ["step-10", "step-15", "step-20", "step-5"]


def test_older_checkpoint_into_fresh_folder(uninterrupted: Path, runs: dict[str, Path]) -> None:
    assert sorted(read_loss_log(runs["older"])) == list(range(6, 21))
    result = compare(uninterrupted, runs["older"], "--only-common-steps")
    assert result.returncode == 0, result.stdout


def test_control_without_rng_restore_differs(uninterrupted: Path, runs: dict[str, Path]) -> None:
    """The comparison can fail: the same resume with the RNG restore switched off is caught."""
    result = compare(uninterrupted, runs["without_rng"], "--only-common-steps")
    assert result.returncode == 1
    assert result.stdout.startswith("first differing step 11:"), result.stdout


def test_two_processes_resume_exactly(llama_uninterrupted_two_processes: Path, runs: dict[str, Path]) -> None:
    result = compare(llama_uninterrupted_two_processes, runs["two_processes"])
    assert result.returncode == 0, result.stdout


def test_resume_from_older_checkpoint_refuses_to_overwrite_newer(stopped_and_resumed: Path) -> None:
    """load_step 5 in a folder holding step-10..20 would save over them: one line, exit 2, nothing touched."""
    before = {p.name: p.stat().st_mtime_ns for p in (stopped_and_resumed / "checkpoint").iterdir()}
    log_before = (stopped_and_resumed / "loss_log.jsonl").read_bytes()
    proc = train(stopped_and_resumed, "--checkpoint.enable", "--checkpoint.load_step", "5",
                 "--lr_scheduler.total_steps", "20", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: this run would save over the existing checkpoints 10, 15, 20 in {stopped_and_resumed / 'checkpoint'}; "
        "resume into a fresh folder with --checkpoint.initial_load_path, or move those checkpoints away"
    ]
    assert {p.name: p.stat().st_mtime_ns for p in (stopped_and_resumed / "checkpoint").iterdir()} == before
    assert (stopped_and_resumed / "loss_log.jsonl").read_bytes() == log_before
