"""The promise for the LLM trainer: a stopped-and-resumed run writes the same loss log, bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from launch import compare, stop_and_resume, train
from torchtitan_rng.loss_log import read_loss_log

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def uninterrupted(llama_uninterrupted: Path) -> Path:
    return llama_uninterrupted


@pytest.fixture(scope="module")
def stopped_and_resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dump = tmp_path_factory.mktemp("llama_B")
    stop_and_resume(dump, stop_at=10, total=20)
    return dump


def test_resumed_log_equals_uninterrupted(uninterrupted: Path, stopped_and_resumed: Path) -> None:
    result = compare(uninterrupted, stopped_and_resumed)
    assert result.returncode == 0, result.stdout
    assert sorted(read_loss_log(stopped_and_resumed)) == list(range(1, 21))
    steps = sorted(p.name for p in (stopped_and_resumed / "checkpoint").iterdir())
    assert steps == ["step-10", "step-15", "step-20", "step-5"]


def test_older_checkpoint_into_fresh_folder(uninterrupted: Path, stopped_and_resumed: Path, tmp_path: Path) -> None:
    train(tmp_path, "--checkpoint.enable", "--checkpoint.initial_load_path", str(stopped_and_resumed / "checkpoint"),
          "--checkpoint.load_step", "5", "--lr_scheduler.total_steps", "20")
    assert sorted(read_loss_log(tmp_path)) == list(range(6, 21))
    result = compare(uninterrupted, tmp_path, "--only-common-steps")
    assert result.returncode == 0, result.stdout


def test_control_without_rng_restore_differs(uninterrupted: Path, stopped_and_resumed: Path, tmp_path: Path) -> None:
    """The comparison can fail: the same resume with the RNG restore switched off is caught."""
    shutil.copytree(stopped_and_resumed / "checkpoint" / "step-10", tmp_path / "checkpoint" / "step-10")
    train(tmp_path, "--checkpoint.enable", "--lr_scheduler.total_steps", "20", "--checkpoint.restore_rng", "false")
    result = compare(uninterrupted, tmp_path, "--only-common-steps")
    assert result.returncode == 1
    assert result.stdout.startswith("first differing step 11:"), result.stdout


def test_two_processes_resume_exactly(llama_uninterrupted_two_processes: Path, tmp_path: Path) -> None:
    stop_and_resume(tmp_path, stop_at=10, total=20, nproc=2)
    result = compare(llama_uninterrupted_two_processes, tmp_path)
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
