"""Start the trainer as real processes from the installed package, in the caller's directory: one process
runs ``python -m torchtitan_rng.train`` (or another entry of the package that takes a training config, as the
replay's), several run the launcher (preflight, then torchrun) on that module. Shared by verify_resume, replay
and the tests; needs no source checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def training_command(config_file: Path, args: list[str], nproc: int = 1) -> list[str]:
    """The command line of one run with ``nproc`` processes on this node."""
    return launch_command("torchtitan_rng.train", ["--job.config_file", str(config_file), *args], nproc)


def launch_command(module: str, args: list[str], nproc: int = 1) -> list[str]:
    """The command line of ``python -m module`` with training flags ``args`` on ``nproc`` processes."""
    trainer = [module, *args]
    if nproc == 1:
        return [sys.executable, "-m", *trainer]
    # As run_train.sh starts it: rank 0's output only, each line tagged with its rank.
    return [sys.executable, "-m", "torchtitan_rng.launch.launcher", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(nproc), "--local-ranks-filter", "0", "--role", "rank", "--tee", "3",
            "--module", *trainer]


def run_training(config_file: Path, args: list[str], *, nproc: int = 1, env: dict[str, str] | None = None,
                 timeout: float | None = None) -> subprocess.CompletedProcess:
    """One training run, its output captured; ``env`` adds to this process's environment. Relative paths in
    ``args`` mean this process's working directory, where the run starts."""
    run_env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.run(training_command(config_file, args, nproc), capture_output=True, text=True,
                          timeout=timeout, env=run_env)
