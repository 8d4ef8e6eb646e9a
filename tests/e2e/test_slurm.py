"""docs/clusters.md's SLURM batch script, extracted as written and submitted with ``sbatch`` to a real one-node
SLURM (tests/support/slurm.py: Debian's slurm-wlm and munge, started here as root), once per way SLURM stops a
job. Each job must end COMPLETED by itself (stopped, requeued, resumed), with a loss log bit-equal to the
never-stopped run's (``compare_losses`` exits 0).

    job        how it is stopped                                        when
    time       ``--time=2 --signal=B:USR1@20``: SLURM's USR1 to the     at step 3 (held there until the signal
               batch shell, passed on by its trap                       reached the rank)
    usr1       ``scancel --signal=USR1``: to the job's step             at step 3
    requeue    ``scontrol requeue``: SIGTERM to the job, then requeued  at step 3
    preempted  a job of a higher-priority partition (``PreemptMode=     at step 3
               REQUEUE``): SIGTERM to the step, then requeued
    first      ``scancel --batch --signal=USR1``: to the batch shell    the launcher's first statement, before
                                                                        it imported torch
    control    as usr1, resumed with ``--checkpoint.restore_rng false``  at step 3: its log must differ
               (a flag after the script's name, passed to the run)
    nodes2     as usr1, a job of two nodes (a rank on each)             at step 3 (saved at 4: two ranks agree
                                                                        a step later)

Stops are deterministic: the run holds at the point (fault injection's hold files) until the stop's signal
reached the held process (its ``signalled-`` file), then goes on. Every job runs side by side with the others;
the preempted one starts first, alone, so that the preempting job (the whole node) takes nothing but it."""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import slurm
from tests.support.launch import REPO, run_env, together, train
from torchtitan_rng import compare_losses
from torchtitan_rng.checkpoint.layout import complete_steps
from torchtitan_rng.fault_injection import ENV_VAR as FAULT_ENV, HOLD_DIR_ENV
from torchtitan_rng.fault_points import SIGNALLED

pytestmark = pytest.mark.slow  # a SLURM cluster and its job chains (CI runs the slow tier)

FLUX = REPO / "train_configs" / "flux_debug.toml"
STEPS = 20  # flux debug's own; checkpoints every 5 steps
TIMEOUT = 600  # seconds a job chain may take at most
# The node has no GPUs; one CPU a job (the partitions share them): the header's resources, overridden.
RESOURCES = ("--gpus-per-node=0", "--cpus-per-task=1")


def docs_script() -> str:
    text = (REPO / "docs" / "clusters.md").read_text()
    return re.search(r"```bash\n(#!/bin/bash\n#SBATCH.*?)```", text, re.S).group(1)


@dataclass(frozen=True)
class Job:
    name: str
    sbatch: tuple[str, ...]  # sbatch's options
    hold: str  # the fault-injection point the first start holds at (POINT:STEP)
    held: str  # its hold file
    act: Callable[[str], None]  # what the test does to the job once it holds
    run_flags: tuple[str, ...] = ()  # after the script's name: passed to the run


def _scancel(*options: str) -> Callable[[str], None]:
    def signal(job_id: str) -> None:
        slurm.command("scancel", *options, job_id)
    return signal


def _requeue(job_id: str) -> None:
    slurm.command("scontrol", "requeue", job_id)


STEP3 = ("before_step:3", "before_step-3-rank0")
JOBS = (
    # SLURM sends it, up to 60 s before the 20 s asked for: from 40 s after a start on, which leaves the last start
    # the time to finish (else every start is stopped before its first step, and the job ends FAILED).
    Job("time", ("--time=2", "--signal=B:USR1@20"), *STEP3, act=lambda job_id: None),
    Job("usr1", (), *STEP3, act=_scancel("--signal=USR1")),
    Job("requeue", (), *STEP3, act=_requeue),
    Job("first", (), "launcher_start:0", "launcher_start-0-launcher", act=_scancel("--batch", "--signal=USR1")),
    Job("control", (), *STEP3, act=_scancel("--signal=USR1"), run_flags=("--checkpoint.restore_rng", "false")),
    # Two nodes (two slurmds on this machine), a launcher and a rank on each: the rendezvous, NODE_RANK.
    Job("nodes2", ("--partition=pair", "--nodes=2"), *STEP3, act=_scancel("--signal=USR1")),
)


def _follow(job_id: str, holds: Path, act: Callable[[str], None]) -> tuple[dict[str, str], float]:
    """Act once the job's first start holds, let that hold go once the signal reached it, let any later
    hold go at once, and return the job's final fields and the seconds from submission to its end."""
    started = time.monotonic()
    acted = False
    while True:
        fields = slurm.job(job_id)
        for held in sorted(path for path in holds.iterdir() if not path.name.startswith(SIGNALLED)):
            if not acted:
                act(job_id)
                acted = True
            if (holds / f"{SIGNALLED}{held.name}").exists():
                held.unlink()
        if fields["JobState"] in slurm.FINAL:
            return fields, time.monotonic() - started
        if time.monotonic() - started > TIMEOUT:
            raise AssertionError(f"job {job_id} not ended within {TIMEOUT} s: {fields}")
        time.sleep(0.1)  # polling the job and its hold files, not a synchronisation delay


def _submit(root: Path, job: Job, script: Path, *extra: str) -> tuple[str, Path]:
    holds = root / f"{job.name}_holds"
    holds.mkdir()
    job_env = run_env({"DUMP": str(root / job.name), "STEPS": str(STEPS), "NGPU": "1", "CONFIG_FILE": str(FLUX),
                       "PYTHON": sys.executable, FAULT_ENV: f"{job.hold}:*:hold", HOLD_DIR_ENV: str(holds)})
    job_id = slurm.submit(*RESOURCES, f"--job-name={job.name}", f"--output={root / job.name}.out", *extra,
                          *job.sbatch, str(script), *job.run_flags, job_env=job_env, cwd=REPO)
    return job_id, holds


def _result(root: Path, job: Job, job_id: str, fields: dict[str, str], seconds: float) -> dict:
    out = root / f"{job.name}.out"
    return {"id": job_id, "fields": fields, "seconds": seconds, "dump": root / job.name,
            "out": out.read_text() if out.exists() else ""}


@pytest.fixture(scope="module")
def cluster() -> None:
    # Fails, saying what to install, where SLURM is absent: no skip. The daemons stay up for the next run
    # (python -m tests.support.slurm stop ends them): a teardown that stopped them could end them under jobs
    # that another setup of this module's fixtures had just submitted.
    slurm.start()


@pytest.fixture(scope="module")
def jobs(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("slurm")
    script = root / "train.sbatch"
    script.write_text(docs_script())
    preempted_runs = threading.Event()  # the others wait until the preempting job has run

    def preempted() -> dict:
        job = Job("preempted", ("--partition=spot",), *STEP3, act=lambda job_id: None)
        job_id, holds = _submit(root, job, script)
        urgent: dict[str, str] = {}

        def preempt(victim: str) -> None:
            urgent["id"] = slurm.submit("--partition=urgent", "--exclusive", *RESOURCES, "--job-name=urgent",
                                        f"--output={root / 'urgent.out'}", "--wrap", "true")
            # It runs once the preempted job's run saved and exited (the hold goes once SIGTERM reached it).
            threading.Thread(target=lambda: (slurm.wait_until_ended(urgent["id"], TIMEOUT), preempted_runs.set()),
                             daemon=True).start()

        try:
            fields, seconds = _follow(job_id, holds, preempt)
        finally:
            preempted_runs.set()
        result = _result(root, job, job_id, fields, seconds)
        result["urgent"] = slurm.job(urgent["id"])
        return result

    def other(job: Job) -> Callable[[], dict]:
        def chain() -> dict:
            preempted_runs.wait(TIMEOUT)
            job_id, holds = _submit(root, job, script)
            return _result(root, job, job_id, *_follow(job_id, holds, job.act))
        return chain

    def no_dump() -> dict:
        preempted_runs.wait(TIMEOUT)
        job_id = slurm.submit(*RESOURCES, "--job-name=no_dump", f"--output={root / 'no_dump.out'}", str(script),
                              job_env=run_env({"DUMP": ""}), cwd=REPO)
        return {"fields": slurm.wait_until_ended(job_id, TIMEOUT), "out": (root / "no_dump.out").read_text()}

    reference, reference_two = root / "reference", root / "reference_two"
    started = time.monotonic()
    results = together(lambda: train(reference, "--checkpoint.enable", config=FLUX, via_run_train=True),
                       lambda: train(reference_two, "--checkpoint.enable", nproc=2, config=FLUX, via_run_train=True),
                       preempted, no_dump, *(other(job) for job in JOBS))
    by_name = {result["fields"]["JobName"]: result for result in (results[2], *results[4:])}
    print(f"slurm jobs: {time.monotonic() - started:.1f} s in all; "
          + ", ".join(f"{name} {result['seconds']:.1f} s" for name, result in by_name.items()))
    return {"reference": reference, "reference_two": reference_two, "no_dump": results[3], **by_name}


def _compare(reference: Path, dump: Path) -> int:
    """``python -m torchtitan_rng.compare_losses REFERENCE DUMP``'s exit status (its main, in this process: a
    comparison of two files needs no core of its own)."""
    return compare_losses.main([str(reference), str(dump)])


def _assert_completed_after_a_restart(result: dict) -> None:
    fields = result["fields"]
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), (fields, result["out"][-3000:])
    assert int(fields["Restarts"]) >= 1, fields  # it was stopped and requeued at least once
    assert complete_steps(result["dump"] / "checkpoint")[-1] == STEPS


@pytest.mark.parametrize("name", ["time", "usr1", "requeue", "preempted"])
def test_a_job_stopped_at_a_step_completes_by_itself_exactly(jobs: dict, name: str) -> None:
    result = jobs[name]
    _assert_completed_after_a_restart(result)
    assert 3 in complete_steps(result["dump"] / "checkpoint")  # saved where the stop came (not a periodic step)
    assert "resumed from" in result["out"]
    assert _compare(jobs["reference"], result["dump"]) == 0


def test_the_signal_passes_through_the_batch_shells_trap(jobs: dict) -> None:
    assert "SIGUSR1: all 1 local ranks checkpointed and exited 0" in jobs["time"]["out"]


def test_preemption_sigterms_the_step_and_slurm_requeues(jobs: dict) -> None:
    assert jobs["preempted"]["urgent"]["JobState"] == "COMPLETED", jobs["preempted"]["urgent"]
    assert "SIGTERM: all 1 local ranks checkpointed and exited 0" in jobs["preempted"]["out"]


def test_a_signal_at_the_jobs_first_moment_requeues_without_a_checkpoint(jobs: dict) -> None:
    result = jobs["first"]
    _assert_completed_after_a_restart(result)
    assert "SIGUSR1: stopped before training started, nothing new to save" in result["out"]
    assert _compare(jobs["reference"], result["dump"]) == 0


def test_control_a_resume_without_the_random_streams_is_caught(jobs: dict, capsys: pytest.CaptureFixture) -> None:
    result = jobs["control"]
    _assert_completed_after_a_restart(result)
    capsys.readouterr()
    assert _compare(jobs["reference"], result["dump"]) == 1
    assert "first differing step 4" in capsys.readouterr().out


def test_a_two_node_job_completes_by_itself_exactly(jobs: dict) -> None:
    result = jobs["nodes2"]
    _assert_completed_after_a_restart(result)
    assert result["fields"]["NumNodes"] == "2", result["fields"]
    assert "2 process(es)" in result["out"] and "resumed from" in result["out"]
    assert 4 in complete_steps(result["dump"] / "checkpoint")  # the step the two ranks agreed on
    assert _compare(jobs["reference_two"], result["dump"]) == 0


def test_no_dump_folder_fails_in_one_line(jobs: dict) -> None:
    fields, out = jobs["no_dump"]["fields"], jobs["no_dump"]["out"]
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "2:0"), fields
    assert out.strip().splitlines() == ["error: DUMP is not set; submit with DUMP=/shared/folder sbatch ..."], out
