"""The package as a new user gets it: installed non-editably into a fresh environment and run from another
directory; and a fresh copy of the repository on a machine whose Python has nothing installed, where the
README's two set-up commands work as written."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.launch import REPO


# The CPU build that lies on this machine's disk (pip finds it without a download).
TORCH = "torch==2.13.0"


def _source_copy(destination: Path) -> Path:
    """The repository's files as a fresh clone of this working tree would have them (nothing ignored)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():  # a file deleted in the working tree but not yet in the index is not copied
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without anything that points Python at this checkout or its interpreter."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHON", "PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    print(f"$ {' '.join(command)}  -> {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc


def _nudge_one_loss(log: Path, step: int) -> None:
    """The loss of ``step`` moved to the next float: the smallest change a comparison must catch."""
    records = [json.loads(line) for line in log.read_text().splitlines()]
    for record in records:
        if record["step"] == step:
            record["loss"] = math.nextafter(record["loss"], math.inf)
    log.write_text("".join(json.dumps(record) + "\n" for record in records))


@dataclass
class FreshMachine:
    folder: Path  # the fresh copy of the repository
    without_torch: subprocess.CompletedProcess  # the control: `python -c "import torch"` on that PATH
    first: subprocess.CompletedProcess  # run_train.sh
    tests: subprocess.CompletedProcess  # run_tests.sh


def _two_commands(tmp_path: Path) -> FreshMachine:
    """A fresh copy, and on PATH a Python with nothing installed; the README's two commands run there."""
    bare = tmp_path / "bare"
    assert _run([sys.executable, "-m", "venv", str(bare)], tmp_path, _clean_env()).returncode == 0
    env = _clean_env(PATH=f"{bare / 'bin'}{os.pathsep}{os.environ['PATH']}")
    without_torch = _run(["python", "-c", "import torch"], tmp_path, env)
    fresh = _source_copy(tmp_path / "fresh")
    first = _run(["bash", "-c", "NGPU=1 CONFIG_FILE=./train_configs/llama_debug.toml ./run_train.sh"], fresh, env)
    tests = _run(["./run_tests.sh", "tests/unit/test_launch_input.py", "-k", "ngpu"], fresh, env)
    return FreshMachine(fresh, without_torch, first, tests)


@pytest.fixture(scope="module")
def fresh_machine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Future[FreshMachine]]:
    """The fresh machine's commands, started in the background: mostly pip on one core, they run beside the
    installed-package test, which asks for this fixture so that it starts first."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool.submit(_two_commands, tmp_path_factory.mktemp("fresh_machine"))


def test_installed_package_from_another_directory(tmp_path: Path, fresh_machine: Future[FreshMachine]) -> None:
    env = _clean_env()
    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env).returncode == 0
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    assert _run([str(python), "-m", "pip", "install", "-q", TORCH], tmp_path, env).returncode == 0
    source = _source_copy(tmp_path / "source")
    assert _run([str(python), "-m", "pip", "install", "-q", str(source)], tmp_path, env).returncode == 0
    shutil.rmtree(source)  # the installed package alone from here on

    user = tmp_path / "user"  # the user's own directory: their config, their relative paths
    user.mkdir()
    shutil.copy(REPO / "train_configs" / "llama_debug.toml", user / "my.toml")
    proc = _run([str(python), "-c", "import torchtitan_rng; print(torchtitan_rng.__file__)"], user, env)
    assert "site-packages" in proc.stdout

    verify = _run([str(bin_dir / "torchtitan-rng-verify"), "--config", "my.toml", "--steps", "4", "--stop-at", "2",
                   "--keep", "kept"], user, env)
    assert verify.returncode == 0 and "PASS: identical: 4 steps" in verify.stdout

    compare = [str(python), "-m", "torchtitan_rng.compare_losses"]
    assert _run([*compare, "kept/A", "kept/B"], user, env).returncode == 0
    _nudge_one_loss(user / "kept" / "B" / "loss_log.jsonl", 3)  # control: one float apart is caught
    differs = _run([*compare, "kept/A", "kept/B"], user, env)
    assert differs.returncode == 1 and "first differing step 3" in differs.stdout

    # Two processes as the README starts them without run_train.sh; the relative dump folder is the caller's.
    two = _run([str(python), "-m", "torchtitan_rng.launch.launcher", "--standalone", "--nnodes", "1",
                "--nproc-per-node", "2", "--module", "torchtitan_rng.train", "--job.config_file", "my.toml",
                "--training.steps", "2", "--job.dump_folder", "two"], user, env)
    assert two.returncode == 0
    assert len((user / "two" / "loss_log.jsonl").read_text().splitlines()) == 2
    for script in ("torchtitan-rng-train", "torchtitan-rng-compare", "torchtitan-rng-verify"):
        assert _run([str(bin_dir / script), "--help"], user, env).returncode == 0


def test_two_commands_on_a_fresh_machine(fresh_machine: Future[FreshMachine]) -> None:
    """run_train.sh sets up .venv once (one line says so), the test command reuses it."""
    machine = fresh_machine.result()
    assert machine.without_torch.returncode != 0  # control: nothing installed
    first, tests = machine.first, machine.tests
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert first.stdout.splitlines()[0].startswith("run_train.sh: no Python here has torch and torchdata; setting up")
    assert len((machine.folder / "outputs" / "llama_debug" / "loss_log.jsonl").read_text().splitlines()) == 20
    assert tests.returncode == 0 and "setting up" not in tests.stdout, tests.stdout[-2000:] + tests.stderr[-2000:]
    assert "4 passed" in tests.stdout
