"""Exact resume with the options of real runs on: gradient accumulation, activation checkpointing, mixed
precision, torch.compile — each alone and all together, llama and flux, 1 and 2 processes.

Every case: run A (6 steps uninterrupted) against run B (stopped at step 3, resumed to 6), losses compared as
float bits; and a control, B's step-3 checkpoint resumed without the RNG restore, which must differ at step 4.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.support.checks import assert_every_line_matches, assert_refused, float_bits
from tests.support.launch import EVERY_STEP, together, train
from torchtitan_rng.checkpoint.owner import OWNER_NAME
from torchtitan_rng.loss_log import read_loss_log


STEPS, STOP_AT = 6, 3
ALL_TOGETHER = ("--compile.enable", "--activation_checkpoint.mode", "selective",
                "--training.mixed_precision_param", "bfloat16")


def assert_resume_exact_with_control(tmp_path: Path, overrides: tuple[str, ...], nproc: int = 1,
                                     config: str = "llama_debug") -> None:
    common = ("--lr_scheduler.total_steps", str(STEPS), "--checkpoint.interval", str(STOP_AT),
              "--validation.enable", "false", *overrides)
    run_as = {"nproc": nproc, "config": config}
    run_a, run_b, control = tmp_path / "A", tmp_path / "B", tmp_path / "control"
    resume = ("--checkpoint.enable", "--training.steps", str(STEPS), *common)
    # B's first run alone: a compiled one fills inductor's cache (the temporary folder's), and the three runs
    # after it, side by side, compile from it instead of each compiling the same graphs at the same time.
    train(run_b, "--checkpoint.enable", "--training.steps", str(STOP_AT), *common, **run_as)
    shutil.copytree(run_b / "checkpoint" / f"step-{STOP_AT}", control / "checkpoint" / f"step-{STOP_AT}")
    together(lambda: train(run_a, "--training.steps", str(STEPS), *common, **run_as),
             lambda: train(run_b, *resume, **run_as),
             lambda: train(control, *resume, "--checkpoint.restore_rng", "false", **run_as))

    uninterrupted = read_loss_log(run_a)
    assert sorted(read_loss_log(run_b)) == sorted(uninterrupted) == list(range(1, STEPS + 1))
    assert_every_line_matches(run_a, run_b)
    step = STOP_AT + 1
    assert float_bits(read_loss_log(control)[step]["loss"]) != float_bits(uninterrupted[step]["loss"])


# A feature whose code path test_all_together also runs every day (llama: compiled, 2 processes) is proved
# alone in the slow tier, which CI runs: there it names the feature when the cases together fail.
ALSO_TOGETHER = pytest.mark.slow


@pytest.mark.parametrize("overrides", [
    # 2 micro-batches per step, with workers and a snapshot every 2 steps (4 micro-batches): the checkpoint
    # at step 3 falls between two snapshots, so the resume replays micro-batches in the restored workers.
    pytest.param(("--training.global_batch_size", "16", "--data.num_workers", "2",
                  "--data.snapshot_every_n_steps", "2"), id="accumulation-workers"),
    # Full AC is in test_several_resumes_in_a_row; per-layer selective AC is the same mechanism.
    pytest.param(("--activation_checkpoint.mode", "selective"), id="ac-selective-op", marks=ALSO_TOGETHER),
    pytest.param(("--training.mixed_precision_param", "bfloat16"), id="bf16-autocast", marks=ALSO_TOGETHER),
    pytest.param(("--compile.enable",), id="compile", marks=ALSO_TOGETHER),
])
def test_llama_feature_alone_one_process(tmp_path: Path, overrides: tuple[str, ...]) -> None:
    assert_resume_exact_with_control(tmp_path, overrides)


@pytest.mark.parametrize("overrides", [
    pytest.param(("--training.global_batch_size", "32"), id="accumulation", marks=ALSO_TOGETHER),
    pytest.param(("--training.mixed_precision_param", "bfloat16"), id="bf16-fsdp-policy", marks=ALSO_TOGETHER),
])
def test_llama_feature_alone_two_processes(tmp_path: Path, overrides: tuple[str, ...]) -> None:
    assert_resume_exact_with_control(tmp_path, overrides, nproc=2)


@pytest.mark.parametrize(("config", "nproc", "compiled"), [
    # Each feature alone runs at 1 process above; together: llama compiled at 2 processes, flux compiled at
    # 1 and uncompiled at 2 (compiling flux at 2 processes would add minutes on 2 CPU cores); flux's in the slow
    # tier, which CI runs.
    ("llama_debug", 2, True), pytest.param("flux_debug", 1, True, marks=pytest.mark.slow),
    pytest.param("flux_debug", 2, False, marks=pytest.mark.slow),
])
def test_all_together(tmp_path: Path, config: str, nproc: int, compiled: bool) -> None:
    """Accumulation (2 micro-batches per rank) + compile + selective AC + bf16."""
    features = ALL_TOGETHER if compiled else tuple(o for o in ALL_TOGETHER if o != "--compile.enable")
    global_batch = str(2 * 8 * nproc)
    assert_resume_exact_with_control(tmp_path, ("--training.global_batch_size", global_batch, *features),
                                     nproc=nproc, config=config)


def test_several_resumes_in_a_row(tmp_path: Path) -> None:
    """Stopped three times — end of steps at an epoch boundary, SIGTERM mid-epoch, end of steps mid-epoch —
    and resumed each time: the log equals the uninterrupted one."""
    total = 10
    # 48 samples = 6 micro-batches of 8 = 3 steps of 2 micro-batches per epoch.
    common = ("--training.global_batch_size", "16", "--data.num_samples", "48", "--data.num_workers", "2",
              "--activation_checkpoint.mode", "full", "--lr_scheduler.total_steps", str(total),
              "--checkpoint.interval", "100", *EVERY_STEP)
    resumed = tmp_path / "B"

    def stop_three_times() -> None:
        train(resumed, "--checkpoint.enable", "--training.steps", "3", *common)
        # The signal arrives before step 5 starts; the ranks stop at the end of step 5 with a checkpoint there.
        train(resumed, "--checkpoint.enable", "--training.steps", str(total), *common,
              env={"TORCHTITAN_RNG_FAULT": "before_step:5:*:SIGTERM"})
        assert max(read_loss_log(resumed)) == 5
        train(resumed, "--checkpoint.enable", "--training.steps", "8", *common)
        train(resumed, "--checkpoint.enable", "--training.steps", str(total), *common)

    together(lambda: train(tmp_path / "A", "--training.steps", str(total), *common), stop_three_times)
    steps = sorted(int(p.name.split("-")[1]) for p in (resumed / "checkpoint").iterdir() if p.name != OWNER_NAME)
    assert steps == [3, 5, 8, total]
    assert sorted(read_loss_log(resumed)) == list(range(1, total + 1))
    assert_every_line_matches(tmp_path / "A", resumed)


def test_global_batch_size_must_divide(tmp_path: Path) -> None:
    proc = train(tmp_path, "--training.global_batch_size", "12", check=False)
    assert_refused(proc, "training.global_batch_size = 12 is not a multiple of local_batch_size x data-parallel "
                         "size = 8 x 1 = 8; for a new run, choose a multiple")
    assert not os.listdir(tmp_path)
