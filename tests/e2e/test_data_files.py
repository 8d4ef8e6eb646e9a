"""Real data files for the LLM trainer, run by the trainer: bad files refused in one line, exact resume of
.bin and .jsonl data."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.support.launch import compare, stop_and_resume, together, train
from tests.support.token_data import write_bad_jsonl
from torchtitan_rng.loss_log import read_loss_log


def test_trainer_refuses_out_of_vocabulary_and_bad_lines_in_one_line(token_files: dict[str, Path], tmp_path: Path) -> None:
    proc = train(tmp_path / "a", "--training.dataset_path", str(token_files["bin"]), "--model.vocab_size", "512", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: config model.vocab_size = 512, but {token_files['bin']} holds token id {_first_at_least(token_files['bin'], 512)[0]} "
        f"(token {_first_at_least(token_files['bin'], 512)[1]}): raise model.vocab_size above 999 or set it to 0 to derive "
        "it from the data"
    ]
    bad = write_bad_jsonl(tmp_path, "not json")
    proc = train(tmp_path / "b", "--training.dataset_path", str(bad), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: config training.dataset_path: {bad} line 3: not valid JSON (Expecting value); each line must be "
        "an object with a \"text\" string"
    ]


def _first_at_least(path: Path, vocab: int) -> tuple[int, int]:
    tokens = np.fromfile(path, dtype="<u2")
    position = int(np.argmax(tokens >= vocab))
    return int(tokens[position]), position


STEPS = ("--training.steps", "8")


@pytest.fixture(scope="module")
def bin_runs(token_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The .bin file: uninterrupted, beside the same run stopped at 4 and resumed to 8."""
    run_a, run_b = tmp_path_factory.mktemp("bin_A"), tmp_path_factory.mktemp("bin_B")
    _uninterrupted_beside_resumed(run_a, run_b, "--training.dataset_path", str(token_files["bin"]))
    return run_a, run_b


def _uninterrupted_beside_resumed(run_a: Path, run_b: Path, *overrides: str, nproc: int = 1) -> None:
    together(lambda: train(run_a, *overrides, *STEPS, nproc=nproc),
             lambda: stop_and_resume(run_b, 4, 8, *overrides, interval=4, nproc=nproc))


def test_bin_resumes_exactly(bin_runs: tuple[Path, Path]) -> None:
    bin_uninterrupted, bin_resumed = bin_runs
    result = compare(bin_uninterrupted, bin_resumed)
    assert result.returncode == 0, result.stdout
    assert sorted(read_loss_log(bin_resumed)) == list(range(1, 9))


def test_bin_control_without_the_data_position_differs(token_files: dict[str, Path], bin_runs: tuple[Path, Path],
                                                       tmp_path: Path) -> None:
    """The comparison catches a real divergence: the same resume with the dataloader's state left out."""
    bin_uninterrupted, bin_resumed = bin_runs
    shutil.copytree(bin_resumed / "checkpoint" / "step-4", tmp_path / "checkpoint" / "step-4")
    train(tmp_path, "--training.dataset_path", str(token_files["bin"]), *STEPS, "--checkpoint.enable",
          "--checkpoint.interval", "4", "--lr_scheduler.total_steps", "8",
          "--checkpoint.exclude_from_loading", "dataloader")
    result = compare(bin_uninterrupted, tmp_path, "--only-common-steps")
    assert result.returncode == 1
    assert result.stdout.startswith("first differing step 5:"), result.stdout


def test_jsonl_resumes_exactly(token_files: dict[str, Path], tmp_path: Path) -> None:
    _uninterrupted_beside_resumed(tmp_path / "A", tmp_path / "B", "--training.dataset_path", str(token_files["jsonl"]))
    result = compare(tmp_path / "A", tmp_path / "B")
    assert result.returncode == 0, result.stdout


def test_bin_two_processes_resume_exactly(token_files: dict[str, Path], tmp_path: Path) -> None:
    _uninterrupted_beside_resumed(tmp_path / "A", tmp_path / "B", "--training.dataset_path", str(token_files["bin"]),
                                  nproc=2)
    result = compare(tmp_path / "A", tmp_path / "B")
    assert result.returncode == 0, result.stdout
