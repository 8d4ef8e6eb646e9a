"""The package as a new user gets it: installed non-editably into a fresh environment and run from another
directory. (The README's two set-up commands on a machine whose Python has nothing installed are checked by
.ci/run itself, on a fresh clone: the suite runs in the environment they set up.)"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch import REPO

pytestmark = pytest.mark.slow  # a fresh virtual environment and pip install (CI runs the slow tier)


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


def test_installed_package_from_another_directory(tmp_path: Path) -> None:
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
