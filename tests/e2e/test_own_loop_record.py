"""ExactResume dropped without close() or ``with``: the loader's workers end before the interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.launch import REPO, run_env


AT_EXIT = """
import atexit, sys
workers = []
# Registered before anything else: it runs after every other exit hook, before interpreter teardown.
atexit.register(lambda: print("alive at exit:", sum(worker.is_alive() for worker in workers), flush=True))
import torch
from torch.utils.data import TensorDataset
from torchtitan_rng import ExactResume, build_dataloader
loader = build_dataloader(TensorDataset(torch.zeros(16, 2)), batch_size=2, seed=0, num_workers=2)
# The workers ignore the stop signals: left to the exit's SIGTERM, they would keep the process waiting forever.
exact = ExactResume(sys.argv[1], model=torch.nn.Linear(2, 1), dataloader=loader, interval=1,
                    stop_signals=("SIGTERM", "SIGUSR1"))
exact.load()
batches = iter(loader)
next(batches)
workers.extend(loader._iterator._workers)
print("alive while training:", sum(worker.is_alive() for worker in workers), flush=True)
"""


def test_without_close_the_workers_end_before_teardown(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", AT_EXIT, str(tmp_path / "checkpoint")], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env=run_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["alive while training: 2", "alive at exit: 0"], proc.stdout
