"""The streaming source in the trainer: a stopped and resumed run logs the uninterrupted run's losses, bit for
bit; another worker count for its checkpoint is refused in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.launch import compare, stop_and_resume, together, train


TRAIN = ("--data.streaming", "--data.shuffle_buffer", "16", "--data.num_samples", "40", "--training.steps", "8")


@pytest.mark.parametrize("kind, num_workers, nproc", [("bin", 0, 1), ("jsonl", 2, 1), ("bin", 2, 2)])
def test_trainer_stream_resumes_exactly(token_files: dict[str, Path], tmp_path: Path, kind: str, num_workers: int,
                                        nproc: int) -> None:
    overrides = ("--training.dataset_path", str(token_files[kind]), "--data.num_workers", str(num_workers), *TRAIN)
    together(lambda: train(tmp_path / "A", *overrides, nproc=nproc),
             lambda: stop_and_resume(tmp_path / "B", 4, 8, *overrides, interval=4, nproc=nproc))
    result = compare(tmp_path / "A", tmp_path / "B")
    assert result.returncode == 0, result.stdout
    if num_workers == 2 and nproc == 1:  # the same checkpoint with another worker count: one line, exit 2
        shutil.copytree(tmp_path / "B" / "checkpoint" / "step-4", tmp_path / "C" / "checkpoint" / "step-4")
        proc = train(tmp_path / "C", *overrides, "--data.num_workers", "1", "--checkpoint.enable",
                     "--lr_scheduler.total_steps", "8", check=False)
        assert proc.returncode == 2
        assert proc.stderr.strip().splitlines() == [
            "error: the checkpoint's stream was split over 1 process(es) x 2 dataloader worker(s) and this run has "
            "1 x 1: each share's file position and shuffle buffer belong to that split; resume with "
            "--data.num_workers 2 on 1 process(es)"
        ]
