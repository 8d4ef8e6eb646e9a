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


def train(dump: Path, *overrides: str, nproc: int = 1, config: str | Path = "llama_debug",
          env: dict[str, str] | None = None, check: bool = True, timeout: float = 600,
          via_run_train: bool = False) -> subprocess.CompletedProcess:
    """One training run into ``dump``; raises with its output when ``check`` and it exits non-zero.

    ``config``: a name in train_configs/ or the Path of a TOML file. One process runs ``train.py``
    directly unless ``via_run_train``; several always go through run_train.sh.
    """
    args = ["--job.dump_folder", str(dump), "--metrics.log_freq", "1000", *overrides]
    config_file = config if isinstance(config, Path) else REPO / "train_configs" / f"{config}.toml"
    proc = run_training(config_file, args, nproc=nproc, env=run_env(env), timeout=timeout,
                        via_run_train=via_run_train)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def compare(a: Path, b: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchtitan_rng.compare_losses", str(a), str(b), *extra],
        cwd=REPO, capture_output=True, text=True, env=run_env(),
    )


def stop_and_resume(dump: Path, stop_at: int, total: int, *overrides: str, nproc: int = 1,
                    config: str | Path = "llama_debug", interval: int = 5, env: dict[str, str] | None = None,
                    via_run_train: bool = False) -> None:
    """Run B of the promise: stop at ``stop_at`` (lr horizon pinned to ``total``), then resume to ``total``."""
    common = ["--checkpoint.enable", "--checkpoint.interval", str(interval), "--lr_scheduler.total_steps", str(total), *overrides]
    run_as = {"nproc": nproc, "config": config, "env": env, "via_run_train": via_run_train}
    train(dump, "--training.steps", str(stop_at), *common, **run_as)
    train(dump, "--training.steps", str(total), *common, **run_as)
