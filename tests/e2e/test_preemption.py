"""Preemption: a checkpoint signal to torchrun or to one rank stops every rank at one step boundary with a
complete checkpoint and exit 0, and the resubmitted run continues the same loss curve, bit for bit."""

from __future__ import annotations

import os
import random
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support.checks import assert_every_line_matches
from tests.support.launch import EVERY_STEP, compare, start, together, train, wait_for_log_lines
from torchtitan_rng.checkpoint.layout import complete_steps
from torchtitan_rng.fault_injection import ENV_VAR as FAULT_ENV
from torchtitan_rng.loss_log import read_loss_log


CKPT = ("--checkpoint.enable", "--checkpoint.interval", "100", *EVERY_STEP)  # only preemption and last-step saves


def _steps_saved(dump: Path) -> list[int]:
    return complete_steps(dump / "checkpoint")


@pytest.fixture(scope="module")
def uninterrupted(llama_uninterrupted_two_processes: Path) -> Path:
    return llama_uninterrupted_two_processes


@pytest.fixture(scope="module")
def preempted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One 2-process job preempted twice, then run to the end:
    1. rank 1 alone gets SIGUSR1 before step 4 (the ranks' vote, read a step later, stops both after step
       5), rank 0 a second signal (SIGTERM) while saving step 5;
    2. SIGTERM to the torchrun parent once the log shows a random step;
    3. the resubmission runs to step 20."""
    dump = tmp_path_factory.mktemp("B")
    first = train(dump, *CKPT, nproc=2, env={FAULT_ENV: "before_step:4:1:SIGUSR1;save_writing:5:0:SIGTERM"})
    after_first = {"steps": _steps_saved(dump), "log": sorted(read_loss_log(dump)), "out": first.stdout}

    signal_at = random.randint(7, 12)
    job = start(dump, *CKPT, nproc=2)
    wait_for_log_lines(dump, signal_at, job)
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=300)
    second = subprocess.CompletedProcess(job.args, job.returncode, out, err)
    after_second = {"steps": _steps_saved(dump), "log": sorted(read_loss_log(dump)), "signal_at": signal_at}

    train(dump, *CKPT, nproc=2)
    return {"dump": dump, "first": first, "after_first": after_first, "second": second, "after_second": after_second}


def test_signal_to_one_rank_stops_all_ranks_at_one_step(preempted: dict) -> None:
    state = preempted["after_first"]
    assert state["steps"] == [5], state  # the second signal during the save did not spoil it
    assert state["log"] == [1, 2, 3, 4, 5]
    assert "stopped by a signal to another rank at step 5" not in state["out"]  # rank 0 got one too
    assert "stopped by SIGTERM at step 5" in state["out"], state["out"]


def test_sigterm_to_torchrun_parent_exits_0_with_checkpoint(preempted: dict) -> None:
    second, state = preempted["second"], preempted["after_second"]
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Traceback" not in second.stdout + second.stderr
    assert "all 2 local ranks checkpointed and exited 0" in second.stdout
    stop = state["steps"][-1]
    assert state["signal_at"] <= stop < 20, state
    assert state["steps"] == [5, stop] and state["log"] == list(range(1, stop + 1))


def test_resumed_log_equals_uninterrupted(uninterrupted: Path, preempted: dict) -> None:
    result = compare(uninterrupted, preempted["dump"])
    assert result.returncode == 0, result.stdout
    assert_every_line_matches(uninterrupted, preempted["dump"])


def test_control_resume_without_rng_differs(uninterrupted: Path, preempted: dict, tmp_path: Path) -> None:
    """The comparison catches a real divergence: the preemption checkpoint without its RNG restore."""
    stop = preempted["after_second"]["steps"][-1]
    train(tmp_path, "--checkpoint.enable", "--checkpoint.initial_load_path", str(preempted["dump"] / "checkpoint"),
          "--checkpoint.load_step", str(stop), "--checkpoint.restore_rng", "false",
          "--training.steps", str(stop + 2), "--lr_scheduler.total_steps", "20", nproc=2)
    result = compare(uninterrupted, tmp_path, "--only-common-steps")
    assert result.returncode == 1
    assert result.stdout.startswith(f"first differing step {stop + 1}:"), result.stdout


def test_configured_signal_only(tmp_path: Path) -> None:
    """signals.checkpoint_on decides: SIGUSR2 checkpoints when listed; SIGUSR1, no longer listed, kills."""
    listed, unlisted = together(
        lambda: train(tmp_path / "usr2", "--signals.checkpoint_on", "SIGUSR2", "--training.steps", "6", *EVERY_STEP,
                      env={FAULT_ENV: "before_step:3:0:SIGUSR2"}),
        lambda: train(tmp_path / "usr1", "--signals.checkpoint_on", "SIGUSR2", "--training.steps", "6",
                      env={FAULT_ENV: "before_step:3:0:SIGUSR1"}, check=False))
    assert "stopped by SIGUSR2 at step 3" in listed.stdout
    assert _steps_saved(tmp_path / "usr2") == [3]
    assert unlisted.returncode == -signal.SIGUSR1
    assert _steps_saved(tmp_path / "usr1") == []


def test_sigterm_to_every_process_with_dataloader_workers(tmp_path: Path) -> None:
    """A cluster signals every process of the job, dataloader workers included: the workers must not die
    of it (the rank would fail with them); the rank saves, and the resume is exact."""
    run = ("--data.num_workers", "2", "--training.steps", "8", "--lr_scheduler.total_steps", "8", *CKPT)

    def signalled() -> subprocess.CompletedProcess:
        job = start(tmp_path / "B", *run, new_session=True)
        wait_for_log_lines(tmp_path / "B", 3, job)
        os.killpg(job.pid, signal.SIGTERM)
        out, err = job.communicate(timeout=300)
        return subprocess.CompletedProcess(job.args, job.returncode, out, err)

    _, job = together(lambda: train(tmp_path / "A", *run), signalled)
    assert job.returncode == 0 and "stopped by SIGTERM at step" in job.stdout, job.stderr[-3000:]
    assert len(_steps_saved(tmp_path / "B")) == 1 and _steps_saved(tmp_path / "B")[0] < 8
    train(tmp_path / "B", *run)
    result = compare(tmp_path / "A", tmp_path / "B")
    assert result.returncode == 0, result.stdout
