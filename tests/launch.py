"""Launch real training runs (plain Python for one process, run_train.sh/torchrun for several)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    env["PYTHON"] = sys.executable
    env.update(extra or {})
    return env


def _command(dump: Path, overrides: tuple[str, ...], nproc: int, config: str) -> tuple[list[str], dict[str, str]]:
    """python train.py for one process, run_train.sh (the launcher, torchrun) for several."""
    args = ["--job.dump_folder", str(dump), "--metrics.log_freq", "1000", *overrides]
    config_file = str(REPO / "train_configs" / f"{config}.toml")
    if nproc == 1:
        cmd = [sys.executable, str(REPO / "train.py"), "--job.config_file", config_file, *args]
    else:
        cmd = ["bash", str(REPO / "run_train.sh"), *args]
    return cmd, {"NGPU": str(nproc), "CONFIG_FILE": config_file}


def start(dump: Path, *overrides: str, nproc: int = 1, config: str = "llama_debug",
          env: dict[str, str] | None = None, new_session: bool = False) -> subprocess.Popen:
    """Like :func:`train` but returns at once; the Popen's pid is the trainer (or, via run_train.sh, the
    torchrun parent: the script execs it), and with ``new_session`` also its process group's id.
    Output is captured as text."""
    cmd, launch_env = _command(dump, overrides, nproc, config)
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=run_env({**launch_env, **(env or {})}), start_new_session=new_session)


def train(dump: Path, *overrides: str, nproc: int = 1, config: str = "llama_debug",
          env: dict[str, str] | None = None, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """One training run into ``dump``; raises with its output when ``check`` and it exits non-zero."""
    cmd, launch_env = _command(dump, overrides, nproc, config)
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env=run_env({**launch_env, **(env or {})}),
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
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


def wait_for_log_lines(dump: Path, lines: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Block until ``dump``'s loss log holds ``lines`` lines (an observed event, not a guessed delay)."""
    log = dump / "loss_log.jsonl"
    deadline = time.monotonic() + timeout
    while not (log.is_file() and log.read_text().count("\n") >= lines):
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before its log had {lines} lines\n"
                                 f"{proc.stdout.read()[-3000:]}\n{proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {lines} lines in {log} after {timeout} s")
        time.sleep(0.01)  # polling interval of the watch, not a synchronisation delay
