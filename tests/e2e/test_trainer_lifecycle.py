"""The trainer's one exit path and its output: a failure still closes everything (a failing save with
dataloader workers used to leave the process hanging), and rank 0 says what the run is and does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from tests.support.launch import start, together, train


def test_failing_save_with_workers_exits_promptly_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "checkpoint").write_text("")  # the checkpoint folder cannot be created: the save of step 2 fails
    proc = start(tmp_path, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2",
                 "--data.num_workers", "2", new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its dataloader workers
        proc.communicate()
        raise AssertionError("the run did not exit after its save failed") from None
    assert proc.returncode == 2, (stdout[-2000:], stderr[-3000:])
    assert "Traceback" not in stdout + stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: saving step 2 into ") and "failed" in lines[0], stderr
    assert [json.loads(line)["step"] for line in (tmp_path / "loss_log.jsonl").read_text().splitlines()] == [1, 2]


def test_banner_save_lines_and_resume_line(tmp_path: Path) -> None:
    common = ("--checkpoint.enable", "--checkpoint.interval", "2", "--lr_scheduler.total_steps", "6")
    first = train(tmp_path, "--training.steps", "4", *common).stdout
    assert "model llama (debug): " in first and " parameters, " in first
    assert f"dump folder {tmp_path}" in first
    assert f"checkpointing into {tmp_path / 'checkpoint'} every 2 steps" in first
    assert "fresh start" in first and "resumed from" not in first
    for step in (2, 4):
        assert f"checkpoint {tmp_path / 'checkpoint' / f'step-{step}'} saved in " in first
    second, off = together(lambda: train(tmp_path, "--training.steps", "6", *common).stdout,
                           lambda: train(tmp_path / "off", "--training.steps", "1").stdout)
    assert f"resumed from {tmp_path / 'checkpoint' / 'step-4'} at step 4" in second and "fresh start" not in second
    assert "checkpointing off" in off
