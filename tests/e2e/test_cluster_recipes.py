"""The recipes of docs/clusters.md, run as written against imitations of each engine's signals and kills (SLURM's
recipe runs against a real SLURM: test_slurm.py):

* Kubernetes: SIGTERM to the launcher alone (PID 1 with an exec-form entrypoint), then SIGKILL of every
  process while the stop's save is still being written (a grace period shorter than the save): no checkpoint is
  picked that is not complete, and the restarted pod's command resumes exactly.
* torchrun ``--max-restarts 1``: a rank killed mid-run; torchrun restarts the ranks, which resume from the
  newest checkpoint by themselves.

Each resumed loss log equals the uninterrupted one bit for bit; the control resumes without the random streams.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checks import assert_every_line_matches
from tests.support.held import start_held
from tests.support.launch import EVERY_STEP, REPO, run_env, together, wait_for_log_lines
from torchtitan_rng.checkpoint.integrity import verify_integrity
from torchtitan_rng.checkpoint.layout import complete_steps, resolve_checkpoint
from torchtitan_rng.fault_injection import ENV_VAR as FAULT_ENV
from torchtitan_rng.launch.run_lock import lock_path

pytestmark = pytest.mark.slow  # the cluster recipes' job chains (CI runs the slow tier)

LLAMA = REPO / "train_configs" / "llama_debug.toml"
# 2 processes, 10 steps on the 20-step curve of the session's uninterrupted 2-process run; saves at 4 and 8.
TWO = ("--training.steps", "10", "--lr_scheduler.total_steps", "20", "--checkpoint.enable",
       "--checkpoint.interval", "4", *EVERY_STEP)


def _launcher(dump: Path, *torchrun: str) -> list[str]:
    return [sys.executable, "-m", "torchtitan_rng.launch.launcher", "--standalone", "--nnodes", "1",
            "--nproc-per-node", "2", *torchrun, "--local-ranks-filter", "0", "--role", "rank", "--tee", "3",
            "--module", "torchtitan_rng.train", "--job.config_file", str(LLAMA), "--job.dump_folder", str(dump),
            *TWO]


# --- Kubernetes and torchrun restarts (2 processes, against the session's uninterrupted 2-process run) --------

@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every engine's runs, side by side."""
    tmp = tmp_path_factory.mktemp("engines")
    k8s, restarted, control = tmp / "k8s", tmp / "restarted", tmp / "control"

    def kubernetes() -> dict:
        # Every save after step 4 is slower than the grace period: it holds until the test has killed everything.
        holds = ";".join(f"save_writing:{step}:*:hold" for step in range(5, 11))
        job = start_held(_launcher(k8s), tmp / "k8s_out", holds)
        wait_for_log_lines(k8s, 5, job.proc)
        job.proc.send_signal(signal.SIGTERM)  # to PID 1 (the launcher) alone
        held = job.wait_held("save_writing-*-rank0")
        # The grace period is over: SIGKILL to every process of the container at once.
        ranks = [json.loads(line)["pid"] for line in lock_path(k8s).read_text().splitlines()[1:]]
        for pid in [*ranks, job.proc.pid]:
            os.kill(pid, signal.SIGKILL)
        killed = job.finish()
        stop = int(held.name.split("-")[1])
        # Seen before the restart, which saves that step again when it is a periodic one (8).
        partial = (k8s / "checkpoint" / f"step-{stop}.partial").is_dir()
        state = {"killed": killed, "held": held.name, "steps": complete_steps(k8s / "checkpoint"),
                 "partial_left": partial, "picked": resolve_checkpoint(k8s / "checkpoint")}
        state["picked_whole"] = verify_integrity(state["picked"])
        state["restart"] = subprocess.run(_launcher(k8s), cwd=REPO, capture_output=True, text=True, timeout=300,
                                          env=run_env())
        return state

    def crash(dump: Path, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([*_launcher(dump, "--max-restarts", "1"), *extra], cwd=REPO, capture_output=True,
                              text=True, timeout=300, env=run_env({FAULT_ENV: "before_step:7:1:SIGKILL"}))

    state, restart, control_run = together(
        kubernetes, lambda: crash(restarted), lambda: crash(control, "--checkpoint.restore_rng", "false"))
    return {"k8s": k8s, **state, "restarted": restarted, "restart_run": restart, "control": control,
            "control_run": control_run}


@pytest.fixture(scope="module")
def engines(runs: dict) -> dict:
    return runs


def test_kubernetes_kill_during_the_save_leaves_no_incomplete_checkpoint_picked(engines: dict) -> None:
    assert engines["killed"].returncode == -signal.SIGKILL
    assert engines["steps"] == [4], engines["steps"]  # the held save never became a step-N
    assert engines["partial_left"], engines["held"]
    assert engines["picked"] == engines["k8s"] / "checkpoint" / "step-4" and engines["picked_whole"]


def test_kubernetes_restart_resumes_exactly(engines: dict, llama_uninterrupted_two_processes: Path) -> None:
    restart = engines["restart"]
    assert restart.returncode == 0, (restart.stdout[-3000:], restart.stderr[-3000:])  # the dead run's lock: no block
    assert f"resumed from {engines['k8s'] / 'checkpoint' / 'step-4'}" in restart.stdout
    assert_every_line_matches(llama_uninterrupted_two_processes, engines["k8s"])


def test_torchrun_restart_resumes_exactly(engines: dict, llama_uninterrupted_two_processes: Path) -> None:
    run = engines["restart_run"]
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    assert f"resumed from {engines['restarted'] / 'checkpoint' / 'step-4'} at step 4" in run.stdout
    assert complete_steps(engines["restarted"] / "checkpoint") == [4, 8, 10]
    logged = [json.loads(line)["step"] for line in (engines["restarted"] / "loss_log.jsonl").read_text().splitlines()]
    assert logged[:6] == [1, 2, 3, 4, 5, 6] and logged[6:] == [5, 6, 7, 8, 9, 10]  # 5-6 redone after the crash
    assert_every_line_matches(llama_uninterrupted_two_processes, engines["restarted"])
    # Control: the same crash and restart, resumed without the random streams, is caught at step 5.
    assert engines["control_run"].returncode == 0, engines["control_run"].stderr[-3000:]
    with pytest.raises(AssertionError, match="step 5:"):
        assert_every_line_matches(llama_uninterrupted_two_processes, engines["control"])
