"""Launch-side bad input and --help: run_train.sh and the entry modules answer in one line (exit 2, no
traceback) or print their usage (exit 0), before any training starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checks import assert_refused
from tests.support.launch import REPO, launch, run_env

RUN_TRAIN = REPO / "run_train.sh"
DEBUG_CONFIG = REPO / "train_configs" / "llama_debug.toml"


def _run(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300, env=run_env(env))


@pytest.mark.parametrize("ngpu", ["0", "-1", "1.5", "two"])
def test_bad_ngpu(ngpu: str, tmp_path: Path) -> None:
    proc = _run(["bash", str(RUN_TRAIN)], tmp_path, {"NGPU": ngpu, "PYTHON": sys.executable})
    assert_refused(proc, f"NGPU={ngpu} is not a process count", "whole number >= 1")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Python with nothing installed (no torch), as on a fresh machine."""
    venv = tmp_path_factory.mktemp("bare")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv / "bin" / "python"


def test_python_without_torch_named_explicitly(bare_python: Path, tmp_path: Path) -> None:
    """PYTHON=... is the user's choice: refused in one line rather than replaced by a set-up."""
    proc = _run(["bash", str(RUN_TRAIN)], tmp_path, {"PYTHON": str(bare_python)})
    assert_refused(proc, f"PYTHON={bare_python} cannot import torch", "unset PYTHON")
    assert "setting up" not in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_python_that_is_not_a_program(tmp_path: Path) -> None:
    assert_refused(_run(["bash", str(RUN_TRAIN)], tmp_path, {"PYTHON": str(tmp_path / "nope")}),
                     "is not a program")


TRAINER = [sys.executable, "-m", "torchtitan_rng.train"]
# (arguments after the trainer's command, fragments of the one line); fail before torch is imported.
TRAINER_CASES = {
    "config file is a directory": (["--job.config_file", str(REPO / "train_configs")], ["is a directory"]),
    "steps without a value": (["--job.config_file", str(DEBUG_CONFIG), "--training.steps"],
                              ["--training.steps needs a value"]),
    "value swallowed by the next flag": (["--job.config_file", str(DEBUG_CONFIG), "--training.steps",
                                          "--checkpoint.enable"], ["--training.steps needs a value"]),
    "config file without a value": (["--job.config_file"], ["--job.config_file needs a value"]),
}


@pytest.mark.parametrize("case", TRAINER_CASES)
def test_trainer_bad_argument(case: str) -> None:
    args, fragments = TRAINER_CASES[case]
    assert_refused(_run([*TRAINER, *args], REPO), *fragments)


def test_config_file_directory_through_run_train_sh(tmp_path: Path) -> None:
    proc = _run(["bash", str(RUN_TRAIN)], tmp_path, {"PYTHON": sys.executable, "CONFIG_FILE": str(tmp_path)})
    assert_refused(proc, f"config file '{tmp_path}' is a directory")
    assert list(tmp_path.iterdir()) == []


def test_bare_flag_still_sets_a_boolean() -> None:
    """Control for the cases above: a bare flag of a true/false key is not refused."""
    from torchtitan_rng.config import parse_args

    assert parse_args(["--job.config_file", str(DEBUG_CONFIG), "--checkpoint.enable"]).checkpoint.enable is True


def test_a_config_handed_on_as_flags_reads_back_equal() -> None:
    """What the replay hands its processes: every key as a flag (lists, booleans, floats, empty strings), read
    back to an equal config; control: without one of the flags the config differs."""
    from torchtitan_rng.config import parse_args, to_flags

    config = parse_args(["--job.config_file", str(DEBUG_CONFIG), "--training.skip_steps", "4-5,9",
                         "--checkpoint.exclude_from_loading", "optimizer,lr_scheduler", "--checkpoint.enable",
                         "--optimizer.lr", "0.1", "--training.spike_guard", "loss,factor=3,warmup=2",
                         "--metrics.log_samples"])
    flags = to_flags(config)
    assert parse_args(flags) == config
    assert parse_args([flag for flag in flags if not flag.startswith("--optimizer.lr=")]) != config


HELP = {
    "trainer module": [*TRAINER, "--help"],
    "train.py": [sys.executable, str(REPO / "train.py"), "-h"],
    "run_train.sh": ["bash", str(RUN_TRAIN), "--help"],
    "verify_resume": [sys.executable, "-m", "torchtitan_rng.verify_resume", "--help"],
    "compare_losses": [sys.executable, "-m", "torchtitan_rng.compare_losses", "--help"],
}


@pytest.mark.parametrize("entry", HELP)
def test_help(entry: str, tmp_path: Path) -> None:
    proc = _run(HELP[entry], tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", (proc.returncode, proc.stderr)
    assert proc.stdout.lower().lstrip().startswith(("usage", "check that")), proc.stdout[:300]
    if entry in ("trainer module", "train.py"):
        assert "--training.steps (int; default 20)" in proc.stdout  # every key with its default
    assert list(tmp_path.iterdir()) == []




# The tools that need torch, each with arguments that, under a Python with torch, are refused without a run.
TOOLS = {"verify_resume": ["--config", str(DEBUG_CONFIG), "--steps", "two", "--stop-at", "1"],
         "replay": ["RUN", "--step", "1"], "samples": ["RUN", "--step", "1"]}


@pytest.mark.parametrize("tool", TOOLS)
def test_tools_under_a_python_without_torch(tool: str, bare_python: Path, tmp_path: Path) -> None:
    """One line naming the Python and what to do, exit 2, nothing written (not a FAIL verdict, not a traceback).
    Control: under the Python that has torch the same command gets past that point (to its own refusal)."""
    command = ["-m", f"torchtitan_rng.{tool}", *TOOLS[tool]]
    proc = _run([str(bare_python), *command], tmp_path)
    assert_refused(proc, f"{bare_python} cannot import torch, which python -m torchtitan_rng.{tool} needs",
                   "run it with the Python that trains")
    assert list(tmp_path.iterdir()) == []
    control = launch([sys.executable, *command], cwd=tmp_path)  # forked warm: this Python's torch is imported
    assert control.returncode == 2 and "cannot import torch" not in control.stderr, control.stderr


def test_locate_under_a_python_without_torch(bare_python: Path, tmp_path: Path) -> None:
    """compare_losses compares without torch; --locate replays, which needs it: one line before any log is read.
    Control: without --locate the same Python gets to the logs (and refuses the missing ones)."""
    command = [str(bare_python), "-m", "torchtitan_rng.compare_losses", "A", "B"]
    assert_refused(_run([*command, "--locate"], tmp_path), f"{bare_python} cannot import torch, which python -m "
                   "torchtitan_rng.compare_losses --locate needs", "run it with the Python that trains")
    control = _run(command, tmp_path)
    assert control.returncode == 2 and "cannot import torch" not in control.stderr, control.stderr
    assert list(tmp_path.iterdir()) == []
