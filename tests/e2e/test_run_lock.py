"""One run per dump folder: a second run on a folder in use refuses in one line; a dead process's lock
does not block."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tests.support.checks import assert_refused
from tests.support.launch import EVERY_STEP, start, train, wait_for_log_lines
from torchtitan_rng.launch.run_lock import lock_path


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
