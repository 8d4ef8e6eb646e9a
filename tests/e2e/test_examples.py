"""Every example resumes exactly through the public API, and each one's control (the API's RNG restore
left out) is caught; the plug-in example's mistakes (unknown model name, a custom module that is missing or
raises) are one line. The public surface itself: test_public_api.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checks import float_bits
from tests.support.launch import REPO, compare, run_env, stop_and_resume, together, train
from torchtitan_rng.loss_log import read_loss_log


EXAMPLES = REPO / "examples"
PLUGIN_CONFIG = EXAMPLES / "plugin" / "noisy_sine.toml"


def with_path(*folders: Path) -> dict[str, str]:
    """PYTHONPATH for a subprocess: ``folders`` first (the repo: nothing is pip-installed in tests)."""
    return {"PYTHONPATH": os.pathsep.join([*map(str, folders), os.environ.get("PYTHONPATH", "")])}


def run_example(script: str, *args: str, nproc: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    """``python examples/SCRIPT`` or, for several processes, the same under torchrun."""
    path = str(EXAMPLES / script)
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    proc = subprocess.run([*launcher, path, *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=run_env(with_path(REPO)))
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def resume_from_copy(source: Path, step: int, dest: Path) -> None:
    """A fresh output folder holding only ``source``'s checkpoint of ``step`` (the stopped run's state)."""
    shutil.copytree(source / "checkpoint" / f"step-{step}", dest / "checkpoint" / f"step-{step}")


def assert_first_difference(a: Path, b: Path, step: int) -> None:
    result = compare(a, b, "--only-common-steps")
    assert result.returncode == 1, result.stdout
    assert result.stdout.startswith(f"first differing step {step}:"), result.stdout


# --- Example 1: a plain DDP loop (2 processes, gloo), stopped mid-epoch and resumed ----------------------

DDP_STEPS, DDP_STOP = 14, 9  # 6 steps per epoch: the stop is in the second epoch


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    uninterrupted, resumed = tmp_path_factory.mktemp("ddp_A"), tmp_path_factory.mktemp("ddp_B")

    def run(out: Path, *stops: int) -> None:
        for steps in stops:
            run_example("ddp_exact_resume.py", "--out", str(out), "--steps", str(steps), nproc=2)

    together(lambda: run(uninterrupted, DDP_STEPS), lambda: run(resumed, DDP_STOP, DDP_STEPS))
    return uninterrupted, resumed


def test_ddp_example_resumes_exactly(ddp_runs: tuple[Path, Path]) -> None:
    uninterrupted, resumed = ddp_runs
    result = compare(uninterrupted, resumed)
    assert result.returncode == 0, result.stdout
    assert sorted(read_loss_log(resumed)) == list(range(1, DDP_STEPS + 1))
    assert sorted(p.name for p in (resumed / "checkpoint").iterdir()) == ["step-12", "step-14", "step-4", "step-8", "step-9"]


def test_ddp_example_control_differs(ddp_runs: tuple[Path, Path], tmp_path: Path) -> None:
    uninterrupted, resumed = ddp_runs
    resume_from_copy(resumed, DDP_STOP, tmp_path)
    run_example("ddp_exact_resume.py", "--out", str(tmp_path), "--steps", str(DDP_STEPS), "--control", nproc=2)
    assert_first_difference(uninterrupted, tmp_path, DDP_STOP + 1)


# --- Example 2: the restore-order experiment (docs/design.md, "The restore point") ------------------------

ORDER_STEPS, ORDER_STOP = 6, 3


@pytest.fixture(scope="module")
def order_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    uninterrupted, resumed = tmp_path_factory.mktemp("order_A"), tmp_path_factory.mktemp("order_B")

    def run(out: Path, *stops: int) -> None:
        for steps in stops:
            run_example("restore_order.py", "--out", str(out), "--steps", str(steps))

    together(lambda: run(uninterrupted, ORDER_STEPS), lambda: run(resumed, ORDER_STOP, ORDER_STEPS))
    return uninterrupted, resumed


def test_restore_order_example_resumes_exactly(order_runs: tuple[Path, Path]) -> None:
    uninterrupted, resumed = order_runs
    result = compare(uninterrupted, resumed)
    assert result.returncode == 0, result.stdout
    a, b = read_loss_log(uninterrupted), read_loss_log(resumed)
    assert all(float_bits(a[step]["output_sum"]) == float_bits(b[step]["output_sum"]) for step in a)


def test_restore_after_fetching_is_refused(order_runs: tuple[Path, Path], tmp_path: Path) -> None:
    """Trainer's order (fetch the first resumed batch, then restore) stops with one clear line."""
    resume_from_copy(order_runs[1], ORDER_STOP, tmp_path)
    proc = run_example("restore_order.py", "--out", str(tmp_path), "--steps", str(ORDER_STEPS),
                       "--order", "get_first", check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "torchtitan_rng.own_loop.RestoreOrderError: restore_rng() was called after the dataloader yielded 1 "
        "batch(es) of this run; call it after iter(dataloader) and before the first batch is fetched"
    )
    assert not (tmp_path / "loss_log.jsonl").exists()  # no step was trained on the wrong batch


def test_restore_order_control_differs(order_runs: tuple[Path, Path], tmp_path: Path) -> None:
    uninterrupted, resumed = order_runs
    resume_from_copy(resumed, ORDER_STOP, tmp_path)
    run_example("restore_order.py", "--out", str(tmp_path), "--steps", str(ORDER_STEPS), "--control")
    assert_first_difference(uninterrupted, tmp_path, ORDER_STOP + 1)


# --- Example 3: a model and dataset from outside the package, trained by run_train.sh --------------------

PLUGIN_STEPS, PLUGIN_STOP = 12, 6
PLUGIN_ENV = with_path(EXAMPLES / "plugin")


@pytest.fixture(scope="module")
def plugin_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    uninterrupted, resumed = tmp_path_factory.mktemp("plugin_A"), tmp_path_factory.mktemp("plugin_B")
    together(lambda: train(uninterrupted, "--training.steps", str(PLUGIN_STEPS), config=PLUGIN_CONFIG, env=PLUGIN_ENV,
                           via_run_train=True),
             lambda: stop_and_resume(resumed, PLUGIN_STOP, PLUGIN_STEPS, config=PLUGIN_CONFIG, env=PLUGIN_ENV,
                                     via_run_train=True))
    return uninterrupted, resumed


def test_plugin_example_resumes_exactly(plugin_runs: tuple[Path, Path]) -> None:
    uninterrupted, resumed = plugin_runs
    result = compare(uninterrupted, resumed)
    assert result.returncode == 0, result.stdout
    assert sorted(read_loss_log(resumed)) == list(range(1, PLUGIN_STEPS + 1))


def test_plugin_control_differs(plugin_runs: tuple[Path, Path], tmp_path: Path) -> None:
    uninterrupted, resumed = plugin_runs
    resume_from_copy(resumed, PLUGIN_STOP, tmp_path)
    train(tmp_path, "--checkpoint.enable", "--training.steps", str(PLUGIN_STEPS), "--lr_scheduler.total_steps",
          str(PLUGIN_STEPS), "--checkpoint.restore_rng", "false", config=PLUGIN_CONFIG, env=PLUGIN_ENV, via_run_train=True)
    assert_first_difference(uninterrupted, tmp_path, PLUGIN_STOP + 1)


def one_line_exit_2(proc: subprocess.CompletedProcess) -> str:
    """The single line a refused run printed (exit 2, nothing else, no traceback)."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def registered_names(line: str, pattern: str) -> set[str]:
    match = re.fullmatch(pattern, line)
    assert match, line
    return set(match.group(1).split(", "))


def test_unknown_model_name_is_one_line(tmp_path: Path) -> None:
    proc = train(tmp_path, "--model.name", "noisy_cosine", config=PLUGIN_CONFIG, env=PLUGIN_ENV,
                 via_run_train=True, check=False)
    names = registered_names(one_line_exit_2(proc), re.escape("error: unknown model.name 'noisy_cosine'; registered: ")
                             + r"(.*)" + re.escape(" (job.custom_module 'my_pkg.my_spec' did not register it)"))
    assert {"llama", "noisy_sine"} <= names


def test_custom_module_not_found_is_one_line(tmp_path: Path) -> None:
    proc = train(tmp_path, "--job.custom_module", "my_pkg.my_spek", config=PLUGIN_CONFIG, env=PLUGIN_ENV,
                 via_run_train=True, check=False)
    names = registered_names(one_line_exit_2(proc), re.escape(
        "error: job.custom_module 'my_pkg.my_spek' not found: no module 'my_pkg.my_spek' on the Python path "
        "(put the folder that holds it on PYTHONPATH); registered model names: ") + r"(.*)")
    assert "llama" in names and "noisy_sine" not in names


def test_custom_module_that_raises_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "broken_spec.py").write_text("import math\nraise RuntimeError('no data in /nowhere\\nsee above')\n")
    proc = train(tmp_path / "run", "--job.custom_module", "broken_spec", config=PLUGIN_CONFIG,
                 env=with_path(tmp_path), via_run_train=True, check=False)
    assert one_line_exit_2(proc) == ("error: job.custom_module 'broken_spec' failed to import: RuntimeError: "
                                     "no data in /nowhere (broken_spec.py:2)")
    assert not (tmp_path / "run").exists()
