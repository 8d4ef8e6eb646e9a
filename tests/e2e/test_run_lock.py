"""One run per dump folder: a second run on a folder in use refuses in one line; a dead process's lock
does not block."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tests.support.checks import assert_clean_exit, assert_refused
from tests.support.held import start_held
from tests.support.launch import EVERY_STEP, REPO, start, train, wait_for_log_lines
from torchtitan_rng.checkpoint.layout import complete_steps
from torchtitan_rng.launch.run_lock import lock_path
from torchtitan_rng.launch.runs import training_command

CONFIG = REPO / "train_configs" / "llama_debug.toml"


def test_second_run_on_the_same_dump_folder_refuses(tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    first = start(dump, "--training.steps", "8", *EVERY_STEP)
    try:
        wait_for_log_lines(dump, 1, first)
        first.send_signal(signal.SIGSTOP)  # alive and holding the lock until SIGCONT: no race with its end
        for nproc in (1, 2):  # python train.py (rank 0 takes the lock) and run_train.sh (the launcher does)
            line = assert_refused(train(dump, check=False, nproc=nproc), "is in use by another run")
            assert f"pid {first.pid} on host {socket.gethostname()}" in line
    finally:
        first.send_signal(signal.SIGCONT)
        out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    logged = (dump / "loss_log.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["step"] for line in logged) == list(range(1, 9))  # the refused ones wrote nothing
    assert not lock_path(dump).exists()


def test_stale_lock_of_a_dead_process_does_not_block(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dump = tmp_path / "dump"
    dump.mkdir()
    lock_path(dump).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(),
                                           "started": "earlier", "token": "x"}))
    train(dump, "--training.steps", "1")
    assert not lock_path(dump).exists()


def test_a_second_run_on_another_runs_checkpoint_folder_refuses_and_the_first_saves_whole(tmp_path: Path) -> None:
    """Two dump folders, one absolute checkpoint folder: the first run holds in its save of step 2 (a fault hold)
    while the second starts, which is refused before it trains, naming the first; released, the first's
    checkpoint is complete. (Two runs held there together once left a step-2 "saved" without its .metadata.)"""
    shared = tmp_path / "shared_checkpoints"
    first, second = tmp_path / "first", tmp_path / "second"
    run = ("--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "2",
           "--checkpoint.folder", str(shared))
    holding = start_held(training_command(CONFIG, ["--job.dump_folder", str(first), *run]), tmp_path / "out",
                         "save_writing:2:0:hold")
    try:
        held = holding.wait_held("save_writing-2-rank0")
        line = assert_refused(train(second, *run, check=False),
                              f"checkpoint folder {shared} belongs to the run of dump folder {first} (its owner.json), "
                              f"not this one ({second})")
        assert "give this run its own --checkpoint.folder" in line
        held.unlink()
        assert_clean_exit(holding.finish())
    except BaseException:
        holding.proc.kill()
        raise
    assert complete_steps(shared) == [2] and (shared / "step-2" / ".metadata").is_file()
    assert not (second / "loss_log.jsonl").exists()  # the refused run trained nothing
