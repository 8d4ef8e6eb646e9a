"""A checkpoint written under one Python resumes under another, bitwise (a cluster whose login node and compute
image differ). CI sets TORCHTITAN_RNG_OTHER_PYTHON to a second interpreter with this project installed
(Debian 12's 3.11.2 runs the suite, pyenv's 3.11.7 is the other): the two pickle DCP's enums in different forms.
"""

from __future__ import annotations

import os
import pickletools
import subprocess
from pathlib import Path

import pytest

from tests.support.launch import REPO, compare, run_env, together, train
from torchtitan_rng.launch.runs import training_command

pytestmark = pytest.mark.slow  # a second interpreter's runs (CI runs the slow tier)


OTHER = os.environ.get("TORCHTITAN_RNG_OTHER_PYTHON", "")
COMMON = ("--checkpoint.enable", "--checkpoint.interval", "3", "--lr_scheduler.total_steps", "6",
          "--data.num_workers", "2")


def _train_other(dump: Path, *overrides: str) -> None:
    """One run under the other interpreter, as :func:`tests.support.launch.train` runs one under this one."""
    args = ["--job.dump_folder", str(dump), "--metrics.log_freq", "1000", *overrides]
    command = training_command(REPO / "train_configs" / "llama_debug.toml", args)
    proc = subprocess.run([OTHER, *command[1:]], cwd=REPO, capture_output=True, text=True, env=run_env(),
                          timeout=600)
    assert proc.returncode == 0, f"{OTHER}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


def _pickles_enums_by_name(checkpoint: Path) -> bool:
    raw = (checkpoint / ".metadata").read_bytes()
    return any(arg == "getattr" for _, arg, _ in pickletools.genops(raw))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if not OTHER:
        pytest.skip("TORCHTITAN_RNG_OTHER_PYTHON is not set (.ci/run sets it to a second interpreter)")
    dumps = {name: tmp_path_factory.mktemp(name) for name in ("uninterrupted", "here_then_other", "other_then_here")}

    def here_then_other() -> None:
        train(dumps["here_then_other"], "--training.steps", "3", *COMMON)
        _train_other(dumps["here_then_other"], "--training.steps", "6", *COMMON)

    def other_then_here() -> None:
        _train_other(dumps["other_then_here"], "--training.steps", "3", *COMMON)
        train(dumps["other_then_here"], "--training.steps", "6", *COMMON)

    together(lambda: train(dumps["uninterrupted"], "--training.steps", "6", *COMMON), here_then_other,
             other_then_here)
    return dumps


def test_the_two_pythons_write_different_pickles(runs: dict[str, Path]) -> None:
    """Control: the pair crosses the two enum forms, so the resumes below read the form the writer did not."""
    here = _pickles_enums_by_name(runs["here_then_other"] / "checkpoint" / "step-3")
    other = _pickles_enums_by_name(runs["other_then_here"] / "checkpoint" / "step-3")
    assert here != other, f"both interpreters pickle enums {'by name' if here else 'by value'}: pick another pair"


@pytest.mark.parametrize("order", ["here_then_other", "other_then_here"])
def test_resumed_under_the_other_python_equals_uninterrupted(runs: dict[str, Path], order: str) -> None:
    result = compare(runs["uninterrupted"], runs[order])
    assert result.returncode == 0, result.stdout + result.stderr
