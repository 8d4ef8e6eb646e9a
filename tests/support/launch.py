"""Launch real training runs (``python -m torchtitan_rng.train`` for one process, the launcher/torchrun for
several, run_train.sh where a test asks for it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from tests.support import cores, zygote
from torchtitan_rng.launch.runs import training_command

REPO = Path(__file__).resolve().parents[2]
# Checkpoints every 2 steps: the bad-input tests' runs save at step 2. The horizon is pinned: their resumes
# go to step 3 or 4 on the saved run's learning-rate curve (a resume may not move it).
STEP2 = ("--checkpoint.enable", "--checkpoint.interval", "2", "--lr_scheduler.total_steps", "4")
# The runs here log every 1000 steps (quiet output), so between checkpoints the loss log is written and a stop
# signal heeded only at the end. A test that watches the log grow, or signals a run and expects it to stop at
# the next step, adds this.
EVERY_STEP = ("--metrics.log_freq", "1")


def run_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every process a test starts. The repository is on PYTHONPATH (after any folders
    ``extra`` puts there), so the processes import the test helpers as ``tests.support...`` wherever they run:
    the custom modules the trainer loads and the scripts started with ``-m``."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    # Inductor compiles in the run's own process: a pool of compile workers beside two ranks on two cores
    # only adds processes (it changes no generated code).
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    env.update(extra or {})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO)]))
    return env


def start(dump: Path, *overrides: str, nproc: int = 1, config: str = "llama_debug",
          env: dict[str, str] | None = None, new_session: bool = False) -> subprocess.Popen:
    """Like :func:`train` but returns at once; the Popen's pid is the trainer (or, for several processes,
    the launcher: the torchrun parent), and with ``new_session`` also its process group's id.
    Output is captured as text."""
    args = ["--job.dump_folder", str(dump), "--metrics.log_freq", "1000", *overrides]
    config_file = REPO / "train_configs" / f"{config}.toml"
    return subprocess.Popen(training_command(config_file, args, nproc), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=run_env(env), start_new_session=new_session)


def train(dump: Path, *overrides: str, nproc: int = 1, config: str | Path = "llama_debug",
          env: dict[str, str] | None = None, check: bool = True, timeout: float = 600,
          via_run_train: bool = False) -> subprocess.CompletedProcess:
    """One training run into ``dump``; raises with its output when ``check`` and it exits non-zero.

    ``config``: a name in train_configs/ or the Path of a TOML file. ``via_run_train``: through
    run_train.sh (NGPU=nproc, this interpreter) instead of the package's own launch.
    """
    args = ["--job.dump_folder", str(dump), "--metrics.log_freq", "1000", *overrides]
    config_file = config if isinstance(config, Path) else REPO / "train_configs" / f"{config}.toml"
    if via_run_train:
        script_env = {"PYTHON": sys.executable, "NGPU": str(nproc), "CONFIG_FILE": str(config_file), **(env or {})}
        proc = launch(["bash", str(REPO / "run_train.sh"), *args], env=run_env(script_env), timeout=timeout,
                      processes=nproc)
    else:
        proc = launch(training_command(config_file, args, nproc), env=run_env(env), timeout=timeout,
                      processes=nproc)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def launch(command: list[str], *, env: dict[str, str] | None = None, cwd: Path = REPO, timeout: float | None = 600,
           processes: int = 1, preload: tuple[str, ...] = (), warm: bool = True) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True)`` for a command that runs to its end: it
    waits for ``processes`` free cores (cores.py), and a Python command (or the one run_train.sh runs) is
    forked from the warm server where that changes nothing the process could see (zygote.py); ``preload``
    names what that server imports beyond torch and this package (an integration's framework, or a script
    whose module runs its imports: ``.../torchtitan_run.py``), for the command and the processes it starts.
    ``TORCHTITAN_RNG_LAUNCH_RECORD`` names a file that gets a line per launch: test, worker, processes,
    seconds waiting for cores, seconds running, warm or not, exit status. ``warm=False``: new interpreters, for a
    run whose start-up randomness is under test (a forked process starts with the server's generator states,
    where a new interpreter seeds torch's and Python's at random)."""
    env = run_env() if env is None else env
    asked = time.monotonic()
    with cores.held(processes):
        started = time.monotonic()
        relay = None
        if warm and command[0] != sys.executable and env.get("PYTHON") == sys.executable:  # run_train.sh's
            relay = zygote.relay_for(env, preload)
            env = {**env, "PYTHON": relay or sys.executable}
        proc = zygote.run(command, env=env, cwd=cwd, timeout=timeout, preload=preload) if warm else None
        warm = proc is not None or relay is not None
        if proc is None:
            proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
        ended = time.monotonic()
    _record({"test": os.environ.get("PYTEST_CURRENT_TEST", "").removesuffix(" (call)"),
             "worker": os.environ.get("PYTEST_XDIST_WORKER", ""), "processes": processes,
             "wait_s": round(started - asked, 3), "run_s": round(ended - started, 3), "warm": warm,
             "exit": proc.returncode, "program": Path(next(arg for arg in command[1:] if arg[:1] != "-")).name})
    return proc


_record_lock = threading.Lock()


def _record(entry: dict[str, Any]) -> None:
    path = os.environ.get("TORCHTITAN_RNG_LAUNCH_RECORD")
    if path:
        with _record_lock, open(path, "a", encoding="utf-8") as file:
            file.write(json.dumps(entry) + "\n")


def together(*jobs: Callable[[], Any]) -> list[Any]:
    """Run independent jobs (each a training run or a chain of them, in its own folders) side by side, each
    launch as soon as its processes have free cores (cores.py); their results in order, the first failure
    raised. The runs are deterministic, so running them side by side changes none of their bits.
    Make their folders before (``tmp_path_factory.mktemp`` is not safe to call from several threads at once)."""
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = [pool.submit(job) for job in jobs]
    return [future.result() for future in futures]


def compare(a: Path, b: Path, *extra: str) -> subprocess.CompletedProcess:
    return launch([sys.executable, "-m", "torchtitan_rng.compare_losses", str(a), str(b), *extra])


def verify(*args: str) -> subprocess.CompletedProcess:
    """``python -m torchtitan_rng.verify_resume`` with ``args``; it holds the cores its runs use."""
    processes = int(args[args.index("--nproc") + 1]) if "--nproc" in args else 1
    return launch([sys.executable, "-m", "torchtitan_rng.verify_resume", *args], processes=processes)


def stop_and_resume(dump: Path, stop_at: int, total: int, *overrides: str, nproc: int = 1,
                    config: str | Path = "llama_debug", interval: int = 5, env: dict[str, str] | None = None,
                    via_run_train: bool = False) -> None:
    """Run B of the promise: stop at ``stop_at`` (lr horizon pinned to ``total``), then resume to ``total``."""
    common = ["--checkpoint.enable", "--checkpoint.interval", str(interval), "--lr_scheduler.total_steps", str(total), *overrides]
    run_as = {"nproc": nproc, "config": config, "env": env, "via_run_train": via_run_train}
    train(dump, "--training.steps", str(stop_at), *common, **run_as)
    train(dump, "--training.steps", str(total), *common, **run_as)


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

