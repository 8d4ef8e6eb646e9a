"""A checkpoint signal to the launcher (what ``run_train.sh`` execs) at any moment of start-up ends the run with
nothing new to save and exit 0, and the same command run again continues the run bit for bit.

One 2-process run in one dump folder: first stopped during step 3 (a checkpoint, so that every start-up after it
resumes: the preflight verifies that checkpoint, the ranks load it), then stopped at each start-up moment below,
then run to its last step, signalled just before it. The moments are fault-injection holds, not delays: the test
waits for a hold, sends SIGUSR1 to the launcher only, waits until the signal reached the held process (its
``signalled-`` file), then lets it go on.

    moment (hold point)                                      process held     ranks started
    launcher_start: first statement, torch not imported      launcher         none
    launcher_preflight: before the preflight                 launcher         none
    launcher_checked: after the preflight                    launcher         none
    launcher_locked: after the dump folder's lock            launcher         none
    launcher_ranks_started: torchrun started the ranks       launcher, ranks  2, held at rank_start
    before_process_group: handlers in, no process group yet  ranks            2
    startup: process group up, model not built               ranks            2
    startup_done: built, resumed, the first step next        ranks            2
"""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest

from tests.support.checks import assert_clean_exit
from tests.support.held import Held, start_held
from tests.support.launch import EVERY_STEP, REPO, compare
from torchtitan_rng.checkpoint.layout import complete_steps
from torchtitan_rng.fault_points import SIGNALLED
from torchtitan_rng.launch.runs import training_command
from torchtitan_rng.loss_log import read_loss_log

CONFIG = REPO / "train_configs" / "llama_debug.toml"
# The conftest's uninterrupted 2-process run: llama_debug's 20 steps; saves only at a stop and the last step.
RUN = ("--checkpoint.enable", "--checkpoint.interval", "100", *EVERY_STEP)
LAUNCHER_POINTS = ("launcher_start", "launcher_preflight", "launcher_checked", "launcher_locked")
RANK_POINTS = ("before_process_group", "startup", "startup_done")
STOPPED = "SIGUSR1: stopped before training started, nothing new to save; run the same command again to resume"


def _start(dump: Path, out: Path, holds: list[str]) -> Held:
    """The run's command (the launcher, 2 ranks) with a hold at each of ``holds`` (``POINT:STEP``, every rank)."""
    command = training_command(CONFIG, ["--job.dump_folder", str(dump), *RUN], nproc=2)
    return start_held(command, out, ";".join(f"{hold}:*:hold" for hold in holds))


def _signal_and_release(job: Held, files: list[str]) -> None:
    """Once the run holds at every one of ``files`` (hold file names): SIGUSR1 to the launcher, then, in the
    order of ``files``, let each held process go on once it has the signal (recorded, or pending while blocked):
    the launcher forwards it to the ranks only once it goes on."""
    try:
        held = [job.wait_held(name) for name in files]
        os.kill(job.proc.pid, signal.SIGUSR1)
        for file in held:
            job.wait_held(SIGNALLED + file.name)
            file.unlink()
    except BaseException:
        job.proc.kill()  # the launcher: its ranks die with it (orphans.py)
        raise


def _state(dump: Path) -> tuple[list[int], dict]:
    return complete_steps(dump / "checkpoint"), read_loss_log(dump)


@pytest.fixture(scope="module")
def stops(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("startup_signals")
    dump = root / "run"
    results: dict = {"dump": dump}

    first = _start(dump, root / "first", ["before_step:3"])
    _signal_and_release(first, ["before_step-3-rank0", "before_step-3-rank1"])
    results["first"] = first.finish()
    results["after_first"] = _state(dump)

    moments: list[tuple[str, list[str], list[str]]] = [
        (point, [f"{point}:0"], [f"{point}-0-launcher"]) for point in LAUNCHER_POINTS]
    # The ranks' interpreters are starting when the launcher gets the signal: they hold at their first statement
    # (signals still blocked there), so the signal the launcher forwards waits in them, pending.
    moments.append(("launcher_ranks_started", ["launcher_ranks_started:0", "rank_start:0"],
                    ["launcher_ranks_started-0-launcher", "rank_start-0-rank0", "rank_start-0-rank1"]))
    moments += [(point, [f"{point}:0"], [f"{point}-0-rank0", f"{point}-0-rank1"]) for point in RANK_POINTS]
    for name, holds, files in moments:
        job = _start(dump, root / name, holds)
        _signal_and_release(job, files)
        results[name] = (job.finish(), _state(dump))

    # Run to its last step, signalled before it: the ranks' vote on it would be read a step later, after the
    # last, so they save the last step and finish; nobody is told to run the command again.
    finish = _start(dump, root / "finish", ["before_step:20"])
    _signal_and_release(finish, ["before_step-20-rank0", "before_step-20-rank1"])
    results["finish"] = finish.finish()
    return results


def test_first_stop_saves_a_checkpoint_to_resume_from(stops: dict) -> None:
    assert_clean_exit(stops["first"])
    steps, log = stops["after_first"]
    assert steps in ([3], [4]) and sorted(log) == list(range(1, steps[0] + 1)), (steps, sorted(log))


@pytest.mark.parametrize("moment", [*LAUNCHER_POINTS, "launcher_ranks_started", *RANK_POINTS])
def test_signal_during_startup_exits_0_with_nothing_new(stops: dict, moment: str) -> None:
    proc, state = stops[moment]
    assert_clean_exit(proc)
    assert STOPPED in proc.stdout.splitlines(), proc.stdout[-3000:]
    assert state == stops["after_first"]  # no checkpoint, no loss-log line: nothing new
    if moment in LAUNCHER_POINTS:  # no rank was started
        assert "[rank0]" not in proc.stdout, proc.stdout[-3000:]
    else:
        assert "[rank0]:stopped by SIGUSR1 during start-up, before step" in proc.stdout, proc.stdout[-3000:]


def test_a_signal_at_the_last_step_says_that_training_is_finished(stops: dict) -> None:
    proc = stops["finish"]
    assert_clean_exit(proc)
    assert "SIGUSR1: all 2 local ranks saved the last step and exited 0; training is finished" in proc.stdout
    assert "run the same command again" not in proc.stdout, proc.stdout[-3000:]
    assert complete_steps(stops["dump"] / "checkpoint")[-1] == 20


def test_same_command_again_continues_exactly(stops: dict, llama_uninterrupted_two_processes: Path,
                                               tmp_path: Path) -> None:
    assert_clean_exit(stops["finish"])
    result = compare(llama_uninterrupted_two_processes, stops["dump"])
    assert result.returncode == 0, result.stdout
    # Control: the comparison catches one loss off by its last bit.
    lines = (stops["dump"] / "loss_log.jsonl").read_text().splitlines()
    record = json.loads(lines[-1])
    record["loss"] = math.nextafter(record["loss"], math.inf)
    (tmp_path / "loss_log.jsonl").write_text("\n".join([*lines[:-1], json.dumps(record)]) + "\n")
    result = compare(llama_uninterrupted_two_processes, tmp_path)
    assert result.returncode == 1, result.stdout


# Ctrl-C in a terminal: SIGINT to the launcher's whole process group (torchrun starts each rank in a session of its
# own and forwards the signal there). Held first where the launcher has not imported torch yet (the signal once
# raised KeyboardInterrupt in whatever was importing), then where torchrun started the ranks.
CTRL_C_MOMENTS = {
    "launcher_start": (["launcher_start:0"], ["launcher_start-0-launcher"]),
    "launcher_ranks_started": (["launcher_ranks_started:0", "rank_start:0"],
                               ["launcher_ranks_started-0-launcher", "rank_start-0-rank0", "rank_start-0-rank1"]),
}


@pytest.mark.usefixtures("sigint_raises_in_children")
@pytest.mark.parametrize("moment", CTRL_C_MOMENTS)
def test_ctrl_c_during_startup_is_the_clean_stop(tmp_path: Path, moment: str) -> None:
    holds, files = CTRL_C_MOMENTS[moment]
    job = _start(tmp_path / "run", tmp_path / "out", holds)
    try:
        held = [job.wait_held(name) for name in files]
        os.killpg(job.proc.pid, signal.SIGINT)
        for file in held:
            job.wait_held(SIGNALLED + file.name)
            file.unlink()
    except BaseException:
        job.proc.kill()
        raise
    proc = job.finish()
    assert_clean_exit(proc)
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr[-3000:]
    assert STOPPED.replace("SIGUSR1", "SIGINT") in proc.stdout.splitlines(), proc.stdout[-3000:]
    log = tmp_path / "run" / "loss_log.jsonl"
    assert not log.exists() or log.read_text() == ""  # no step was trained
