"""The promise for the Flux trainer: noise, timesteps and prompt dropout resume exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.launch import compare, stop_and_resume, together, train
from torchtitan_rng.loss_log import read_loss_log


FLUX = "flux_debug"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One process, no workers: uninterrupted, beside the same run stopped at 10 and resumed to 20."""
    run_a, run_b = tmp_path_factory.mktemp("flux_A"), tmp_path_factory.mktemp("flux_B")
    together(lambda: train(run_a, config=FLUX), lambda: stop_and_resume(run_b, 10, 20, config=FLUX))
    return run_a, run_b


@pytest.fixture(scope="module")
def uninterrupted(one_process: tuple[Path, Path]) -> Path:
    return one_process[0]


# 2 processes without workers: the slow tier, which CI runs (2 with workers and 1 without stay every day).
@pytest.mark.parametrize("nproc,workers", [(1, 0), (1, 2), pytest.param(2, 0, marks=pytest.mark.slow), (2, 2)])
def test_flux_resume_is_exact(nproc: int, workers: int, tmp_path: Path, one_process: tuple[Path, Path]) -> None:
    flags = ("--data.num_workers", str(workers))
    if (nproc, workers) == (1, 0):
        run_a, run_b = one_process
    else:
        run_a, run_b = tmp_path / "A", tmp_path / "B"
        together(lambda: train(run_a, *flags, nproc=nproc, config=FLUX),
                 lambda: stop_and_resume(run_b, 10, 20, *flags, nproc=nproc, config=FLUX))
    result = compare(run_a, run_b)
    assert result.returncode == 0, result.stdout


def test_validation_does_not_move_training_streams(uninterrupted: Path, tmp_path: Path) -> None:
    train(tmp_path, "--validation.enable", "false", config=FLUX)
    assert "val_loss" in read_loss_log(uninterrupted)[5]
    assert "val_loss" not in read_loss_log(tmp_path)[5]
    assert (uninterrupted / "validation" / "step-20.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    result = compare(uninterrupted, tmp_path)
    assert result.returncode == 0, result.stdout


def test_control_without_device_rng_differs(one_process: tuple[Path, Path], tmp_path: Path) -> None:
    """Without the restored generators (on the CPU the device generator is the CPU one) the noise differs."""
    uninterrupted, stopped_at_10 = one_process  # stopped on the 20-step curve (the horizon may not move)
    train(tmp_path / "C", "--checkpoint.enable", "--checkpoint.initial_load_path", str(stopped_at_10 / "checkpoint"),
          "--checkpoint.load_step", "10", "--lr_scheduler.total_steps", "20", "--checkpoint.restore_rng", "false",
          config=FLUX)
    result = compare(uninterrupted, tmp_path / "C", "--only-common-steps")
    assert result.returncode == 1
    assert result.stdout.startswith("first differing step 11:"), result.stdout
