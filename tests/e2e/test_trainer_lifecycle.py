"""The trainer's one exit path and its output: a failure still closes everything (a failing save with
dataloader workers used to leave the process hanging), and rank 0 says what the run is and does."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

from tests.support.held import start_held
from tests.support.launch import REPO, together, train
from torchtitan_rng.launch.runs import training_command

CONFIG = REPO / "train_configs" / "llama_debug.toml"


def test_failing_save_with_workers_exits_promptly_in_one_line(tmp_path: Path) -> None:
    dump = tmp_path / "run"
    holding = start_held(training_command(CONFIG, ["--job.dump_folder", str(dump), "--metrics.log_freq", "1000",
                                                   "--training.steps", "4", "--checkpoint.enable",
                                                   "--checkpoint.interval", "2", "--data.num_workers", "2"]),
                         tmp_path / "out", "before_step:2:0:hold")
    try:
        held = holding.wait_held("before_step-2-rank0")
        # The folder the run claimed at start becomes a file: the save of step 2 cannot create its step folder.
        shutil.rmtree(dump / "checkpoint")
        (dump / "checkpoint").write_text("")
        held.unlink()
        proc = holding.finish(timeout=240)
    finally:
        if holding.proc.poll() is None:
            os.killpg(holding.proc.pid, signal.SIGKILL)  # the trainer and its dataloader workers
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: saving step 2 into ") and "failed" in lines[0], proc.stderr
    assert [json.loads(line)["step"] for line in (dump / "loss_log.jsonl").read_text().splitlines()] == [1, 2]


def test_a_checkpoint_folder_that_is_a_file_is_refused_before_training(tmp_path: Path) -> None:
    (tmp_path / "checkpoint").write_text("")
    proc = train(tmp_path, "--training.steps", "4", "--checkpoint.enable", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip() == (f"error: checkpoint folder {tmp_path / 'checkpoint'} is a file, not a folder: "
                                   "move it away, or pass another --checkpoint.folder"), proc.stderr
    assert not (tmp_path / "loss_log.jsonl").exists() and (tmp_path / "checkpoint").read_text() == ""


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
