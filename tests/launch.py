"""Launch real training runs (plain Python for one process, run_train.sh/torchrun for several)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from torchtitan_rng.training_runs import run_training

REPO = Path(__file__).resolve().parents[1]


def run_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    env.update(extra or {})
    return env


def train(dump: Path, *overrides: str, nproc: int = 1, config: str = "llama_debug",
          env: dict[str, str] | None = None, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """One training run into ``dump``; raises with its output when ``check`` and it exits non-zero."""
    args = ["--job.dump_folder", str(dump), "--metrics.log_freq", "1000", *overrides]
    config_file = REPO / "train_configs" / f"{config}.toml"
    proc = run_training(config_file, args, nproc=nproc, env=run_env(env), timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def compare(a: Path, b: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchtitan_rng.compare_losses", str(a), str(b), *extra],
        cwd=REPO, capture_output=True, text=True, env=run_env(),
    )


def stop_and_resume(dump: Path, stop_at: int, total: int, *overrides: str, nproc: int = 1,
                    config: str = "llama_debug", interval: int = 5) -> None:
    """Run B of the promise: stop at ``stop_at`` (lr horizon pinned to ``total``), then resume to ``total``."""
    common = ["--checkpoint.enable", "--checkpoint.interval", str(interval), "--lr_scheduler.total_steps", str(total), *overrides]
    train(dump, "--training.steps", str(stop_at), *common, nproc=nproc, config=config)
    train(dump, "--training.steps", str(total), *common, nproc=nproc, config=config)
