"""Exact resume on an accelerator (CUDA): runs where one is present, skips with the reason elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.launch import compare, stop_and_resume, train
from torchtitan_rng import device

pytestmark = pytest.mark.skipif(device.device_type != "cuda",
                                reason=f"no CUDA device here (device_type is {device.device_type!r})")


@pytest.mark.parametrize("config", ["llama_debug", "flux_debug"])
def test_resume_on_cuda_is_exact_and_control_differs(config: str, tmp_path: Path) -> None:
    flags = ("--debug.deterministic",)
    run_a, run_b, control = tmp_path / "A", tmp_path / "B", tmp_path / "control"
    train(run_a, *flags, config=config)
    stop_and_resume(run_b, 10, 20, *flags, config=config)
    result = compare(run_a, run_b)
    assert result.returncode == 0, result.stdout
    # Control: the same resume without restoring the random streams (device generator included) differs.
    train(control, "--checkpoint.enable", "--checkpoint.initial_load_path", str(run_b / "checkpoint"),
          "--checkpoint.load_step", "10", "--lr_scheduler.total_steps", "20", "--checkpoint.restore_rng", "false",
          *flags, config=config)
    assert compare(run_a, control, "--only-common-steps").returncode == 1


def test_more_processes_than_devices_is_one_line(tmp_path: Path) -> None:
    """Two ranks on one device would fail inside NCCL with a traceback; the run says what to change."""
    count = device.device_module.device_count()
    proc = train(tmp_path / "run", nproc=count + 1, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "each process needs a device of its own" in line]
    assert lines and "Traceback" not in proc.stderr, proc.stderr
