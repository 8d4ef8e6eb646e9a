"""Start the trainer as real processes, the way a user does: ``python train.py`` for one process,
``run_train.sh`` (preflight, then torchrun) for several. Shared by verify_resume and the tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# train.py and run_train.sh live at the root of the source tree, next to this package.
REPO = Path(__file__).resolve().parents[2]


class EntryScriptMissing(RuntimeError):
    """The entry scripts are missing (an installed package without its source tree)."""


def training_command(config_file: Path, args: list[str], nproc: int = 1, via_run_train: bool = False) -> list[str]:
    """``python -m torchtitan_rng.train`` for one process unless ``via_run_train``; run_train.sh for several."""
    if nproc == 1 and not via_run_train:
        return [sys.executable, "-m", "torchtitan_rng.train", "--job.config_file", str(config_file), *args]
    script = REPO / "run_train.sh"
    if not script.is_file():
        raise EntryScriptMissing(f"{script} not found: run this from a source checkout of torchtitan_rng")
    return ["bash", str(script), *args]


def run_training(config_file: Path, args: list[str], *, nproc: int = 1, env: dict[str, str] | None = None,
                 timeout: float | None = None, via_run_train: bool = False) -> subprocess.CompletedProcess:
    """One training run, its output captured; ``env`` adds to this process's environment."""
    run_env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHON": sys.executable, "NGPU": str(nproc),
               "CONFIG_FILE": str(config_file), **(env or {})}
    return subprocess.run(training_command(config_file, args, nproc, via_run_train), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=run_env)
