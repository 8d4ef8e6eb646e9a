"""The recipes of docs/clusters.md, run as written against imitations of each engine's signals and kills:

* SLURM: the batch script of the docs, with ``srun``/``scontrol`` imitated; USR1 to the batch shell alone
  (``--signal=B:USR1@...``) checkpoints the run, the script requeues the job, the requeued job finishes.
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
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checks import assert_every_line_matches
from tests.support.held import start_held
from tests.support.launch import EVERY_STEP, REPO, run_env, together, train, wait_for_log_lines
from torchtitan_rng.checkpoint.integrity import verify_integrity
from torchtitan_rng.checkpoint.layout import complete_steps, resolve_checkpoint
from torchtitan_rng.fault_injection import ENV_VAR as FAULT_ENV
from torchtitan_rng.launch.run_lock import lock_path

pytestmark = pytest.mark.slow  # the cluster recipes' job chains (CI runs the slow tier)

LLAMA = REPO / "train_configs" / "llama_debug.toml"
FLUX = REPO / "train_configs" / "flux_debug.toml"
# 2 processes, 10 steps on the 20-step curve of the session's uninterrupted 2-process run; saves at 4 and 8.
TWO = ("--training.steps", "10", "--lr_scheduler.total_steps", "20", "--checkpoint.enable",
       "--checkpoint.interval", "4", *EVERY_STEP)


def _launcher(dump: Path, *torchrun: str) -> list[str]:
    return [sys.executable, "-m", "torchtitan_rng.launch.launcher", "--standalone", "--nnodes", "1",
            "--nproc-per-node", "2", *torchrun, "--local-ranks-filter", "0", "--role", "rank", "--tee", "3",
            "--module", "torchtitan_rng.train", "--job.config_file", str(LLAMA), "--job.dump_folder", str(dump),
            *TWO]


# --- SLURM ---------------------------------------------------------------------------------------------------

STEPS = 20  # flux debug's own


def _slurm_script() -> str:
    text = (REPO / "docs" / "clusters.md").read_text()
    return re.search(r"```bash\n(#!/bin/bash\n#SBATCH.*?)```", text, re.S).group(1)


def _slurm_job(tmp: Path, dump: Path, steps: int) -> subprocess.Popen:
    """The docs' batch script as SLURM runs it: bash in the job's directory; srun runs its command (one
    task, this node), scontrol notes what it was asked."""
    bin_dir = tmp / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        (bin_dir / "srun").write_text('#!/bin/sh\nexec "$@"\n')
        (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp / "scontrol.log"}\n')
        for tool in ("srun", "scontrol"):
            (bin_dir / tool).chmod(0o755)
        (tmp / "job.sbatch").write_text(_slurm_script())
    env = run_env({"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "DUMP": str(dump),
                   "STEPS": str(steps), "NGPU": "1", "CONFIG_FILE": str(FLUX), "PYTHON": sys.executable})
    return subprocess.Popen(["bash", str(tmp / "job.sbatch")], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def _finished(job: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = job.communicate(timeout=300)
    return subprocess.CompletedProcess(job.args, job.returncode, out, err)


def _slurm_jobs(tmp: Path) -> list:
    """The uninterrupted run and the preempted-then-requeued job, to run beside the other engines' runs."""
    reference, dump = tmp / "slurm_reference", tmp / "slurm"

    def preempted_then_requeued() -> dict:
        job = _slurm_job(tmp, dump, steps=STEPS)
        wait_for_log_lines(dump, 5, job)  # the recipe's run writes its loss log every 5 steps
        job.send_signal(signal.SIGUSR1)  # the batch shell alone
        first = _finished(job)
        after_first = complete_steps(dump / "checkpoint")
        requeues = (tmp / "scontrol.log").read_text() if (tmp / "scontrol.log").exists() else ""
        second = _finished(_slurm_job(tmp, dump, steps=STEPS))
        return {"first": first, "after_first": after_first, "requeues": requeues, "second": second,
                "requeues_after": (tmp / "scontrol.log").read_text(), "reference": reference, "dump": dump}

    return [lambda: train(reference, config=FLUX, via_run_train=True), preempted_then_requeued]


@pytest.fixture(scope="module")
def slurm(runs: dict) -> dict:
    return runs["slurm"]


def test_slurm_usr1_to_the_batch_shell_checkpoints_and_requeues(slurm: dict) -> None:
    first = slurm["first"]
    assert first.returncode == 0, (first.stdout[-3000:], first.stderr[-3000:])
    assert "SIGUSR1: all 1 local ranks checkpointed and exited 0" in first.stdout
    stop = slurm["after_first"][-1]
    assert 5 <= stop < STEPS, slurm["after_first"]
    assert slurm["requeues"] == "requeue 4242\n"


def test_slurm_requeued_job_finishes_and_stops_requeueing(slurm: dict) -> None:
    second = slurm["second"]
    assert second.returncode == 0, second.stderr[-3000:]
    assert complete_steps(slurm["dump"] / "checkpoint")[-1] == STEPS
    assert slurm["requeues_after"] == "requeue 4242\n"  # finished: not requeued again
    assert_every_line_matches(slurm["reference"], slurm["dump"])


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

    state, restart, control_run, _, slurm_state = together(
        kubernetes, lambda: crash(restarted), lambda: crash(control, "--checkpoint.restore_rng", "false"),
        *_slurm_jobs(tmp))
    return {"k8s": k8s, **state, "restarted": restarted, "restart_run": restart, "control": control,
            "control_run": control_run, "slurm": slurm_state}


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
