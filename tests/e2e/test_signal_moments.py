"""A stop signal at every moment of a run ends it cleanly: during start-up with nothing to save, otherwise with a
complete checkpoint at the step it agreed on, and exit 0; the first Ctrl-C (SIGINT) stops the same way, a
second one aborts at once. One run (flux debug, 2 dataloader workers) is stopped again and again, each time at
another moment, each signal sent to the whole process group (workers included) while the run holds at a
fault-injection point; resumed, its loss log is bit for bit the uninterrupted run's.

    moment                          signal              run ends with
    start-up                        SIGTERM             exit 0, nothing saved
    data loading of step 1          SIGTERM             step-1, exit 0
    validation of step 3            SIGINT (Ctrl-C)     step-3, exit 0
    the save of step 4              SIGINT, then again  aborted by the second: step-4 stays .partial
    the save of step 4 (sync)       SIGTERM             step-4, then step-5, exit 0
    the save of step 6 (async)      SIGTERM             step-6, then step-7, exit 0
    the final save (step 8)         SIGTERM             step-8, exit 0

During data loading both workers hold in ``__getitem__`` of their first sample, so step 1 waits for its batch.
Beside that run, another (``compile.enable``, the loss compiled: the smallest graph) is signalled while
torch.compile builds the graph of its first step, inductor's compile workers in the group too: step-1, exit 0.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support.checks import assert_clean_exit, assert_every_line_matches
from tests.support.held import Held, start_held
from tests.support.launch import EVERY_STEP, REPO, together, train
from torchtitan_rng.checkpoint.integrity import verify_integrity
from torchtitan_rng.checkpoint.layout import complete_steps
from torchtitan_rng.checkpoint.owner import OWNER_NAME
from torchtitan_rng.launch.runs import training_command
from torchtitan_rng.loss_log import read_loss_log


STEPS = 8
RUN = ("--training.steps", str(STEPS), "--lr_scheduler.total_steps", str(STEPS), "--checkpoint.enable",
       "--checkpoint.interval", "2", "--validation.enable", "--validation.freq", "3", "--data.num_workers", "2",
       *EVERY_STEP)
CONFIG = REPO / "train_configs" / "flux_debug.toml"
NOTICE = "SIGINT: saving a checkpoint at the next step boundary, then exiting; press Ctrl-C again to abort"


def _held(dump: Path, out: Path, holds: list[str], *extra: str) -> Held:
    """The run with a hold at each of ``holds`` (``POINT:STEP``, rank 0)."""
    command = training_command(CONFIG, ["--job.dump_folder", str(dump), *RUN, *extra])
    return start_held(command, out, ";".join(f"{hold}:0:hold" for hold in holds))


def _signal_at(job: Held, holds: list[str], signum: int) -> None:
    """Once the run holds at every one of ``holds``: ``signum`` to its whole process group (dataloader workers
    included), then let it go on."""
    held = [job.wait_held(f"{hold.replace(':', '-')}-rank0") for hold in holds]
    os.killpg(job.proc.pid, signum)
    for file in held:
        file.unlink()


def _stopped(dump: Path, out: Path, holds: list[str], signum: int, *extra: str) -> subprocess.CompletedProcess:
    job = _held(dump, out, holds, *extra)
    _signal_at(job, holds, signum)
    return job.finish()


@pytest.fixture(scope="module")
def moments(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("moments")
    reference, dump, control, compiled = root / "reference", root / "run", root / "control", root / "compiled"
    results: dict = {"reference": reference, "dump": dump, "control": control}

    def stopped_again_and_again() -> None:
        results["startup"] = _stopped(dump, root / "startup", ["startup:0"], signal.SIGTERM)
        results["after_startup"] = (complete_steps(dump / "checkpoint"), read_loss_log(dump) if
                                    (dump / "loss_log.jsonl").exists() else {})

        # The run holds before step 1 and both workers at their first sample; the run goes on into step 1 and
        # waits for its batch, then the signal comes, then the workers go on.
        loading = _held(dump, root / "data_loading", ["before_step:1", "data_loading:0"])
        workers = loading.wait_all_held("data_loading-0-rank0-worker*", 2)
        loading.wait_held("before_step-1-rank0").unlink()
        os.killpg(loading.proc.pid, signal.SIGTERM)
        for file in workers:
            file.unlink()
        results["data_loading"] = loading.finish()
        results["after_data_loading"] = complete_steps(dump / "checkpoint")
        results["validation"] = _stopped(dump, root / "validation", ["validation:3"], signal.SIGINT)
        results["after_validation"] = complete_steps(dump / "checkpoint")

        abort = _held(dump, root / "abort", ["before_step:4", "save_writing:4"])
        _signal_at(abort, ["before_step:4"], signal.SIGINT)
        _signal_at(abort, ["save_writing:4"], signal.SIGINT)
        results["abort"] = abort.finish()
        entries = sorted(p.name for p in (dump / "checkpoint").iterdir() if p.name != OWNER_NAME)
        results["after_abort"] = (complete_steps(dump / "checkpoint"), entries)

        results["sync"] = _stopped(dump, root / "sync", ["save_writing:4"], signal.SIGTERM)
        results["after_sync"] = complete_steps(dump / "checkpoint")
        # The control beside the async run: the sync stop's checkpoint resumed without its random streams.
        control.mkdir()
        shutil.copy(dump / "loss_log.jsonl", control / "loss_log.jsonl")
        shutil.copytree(dump / "checkpoint" / "step-5", control / "checkpoint" / "step-5")
        results["async"], _ = together(
            # The background write of step 6 holds, and the loop before step 7: the signal comes mid-write.
            lambda: _stopped(dump, root / "async", ["save_writing:6", "before_step:7"], signal.SIGTERM,
                             "--checkpoint.async_mode", "async"),
            lambda: train(control, *RUN, "--checkpoint.restore_rng", "false", config=CONFIG))
        results["after_async"] = complete_steps(dump / "checkpoint")
        results["final"] = _stopped(dump, root / "final", ["save_writing:8"], signal.SIGTERM)

    def stopped_while_compiling() -> None:
        results["compile"] = _stopped(compiled, root / "compile", ["compile:1"], signal.SIGTERM, "--compile.enable",
                                      "--compile.components", "loss")
        results["after_compile"] = complete_steps(compiled / "checkpoint")

    together(lambda: train(reference, *RUN, config=CONFIG), stopped_again_and_again, stopped_while_compiling)
    return results


def test_signal_during_startup_exits_0_with_nothing_to_save(moments: dict) -> None:
    assert_clean_exit(moments["startup"])
    assert "stopped by SIGTERM during start-up, before step 1: nothing new to save" in moments["startup"].stdout
    assert moments["after_startup"] == ([], {})


def test_signal_during_data_loading_saves_the_step_waiting_for_it(moments: dict) -> None:
    assert_clean_exit(moments["data_loading"])
    assert "stopped by SIGTERM at step 1" in moments["data_loading"].stdout
    assert moments["after_data_loading"] == [1]


def test_signal_during_the_first_compile_saves_that_step(moments: dict) -> None:
    assert_clean_exit(moments["compile"])
    assert "stopped by SIGTERM at step 1" in moments["compile"].stdout
    assert moments["after_compile"] == [1]


def test_first_ctrl_c_during_validation_saves_that_step(moments: dict) -> None:
    proc = moments["validation"]
    assert_clean_exit(proc)
    assert proc.stderr.strip() == NOTICE + " without saving"
    assert "stopped by SIGINT at step 3" in proc.stdout
    assert moments["after_validation"] == [1, 2, 3]


def test_second_ctrl_c_aborts_and_blocks_nothing(moments: dict) -> None:
    proc = moments["abort"]
    assert proc.returncode == -signal.SIGINT, (proc.returncode, proc.stderr[-3000:])
    assert proc.stderr.strip() == NOTICE + " without saving"  # one line: what the first one said
    steps, entries = moments["after_abort"]
    assert steps == [1, 2, 3] and entries == ["step-1", "step-2", "step-3", "step-4.partial"]
    # The next run was not blocked (the aborted run's lock names a dead process) and resumed from step 3.
    assert "resumed from" in moments["sync"].stdout and "step-3 at step 3" in moments["sync"].stdout


def test_signal_during_a_sync_save_stops_at_the_next_step(moments: dict) -> None:
    proc = moments["sync"]
    assert_clean_exit(proc)
    assert "stopped by SIGTERM at step 5" in proc.stdout
    assert moments["after_sync"] == [1, 2, 3, 4, 5]


def test_signal_during_an_async_save_stops_at_the_next_step(moments: dict) -> None:
    proc = moments["async"]
    assert_clean_exit(proc)
    assert "checkpoint step-6: staged in" in proc.stdout and "step-6 saved in" in proc.stdout
    assert "stopped by SIGTERM at step 7" in proc.stdout
    assert moments["after_async"] == [1, 2, 3, 4, 5, 6, 7]


def test_signal_during_the_final_save_finishes_it(moments: dict) -> None:
    assert_clean_exit(moments["final"])
    steps = complete_steps(moments["dump"] / "checkpoint")
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]
    assert all(verify_integrity(moments["dump"] / "checkpoint" / f"step-{step}") for step in steps)


def test_every_save_prints_its_time(moments: dict) -> None:
    """The time a save takes is what a cluster's lead time must cover: printed with each one."""
    for name in ("data_loading", "compile", "validation", "sync", "async", "final"):
        assert " saved in " in moments[name].stdout, moments[name].stdout


def test_log_after_all_stops_equals_uninterrupted(moments: dict) -> None:
    assert_every_line_matches(moments["reference"], moments["dump"])
    # Control: the comparison catches the same resume without its random streams.
    with pytest.raises(AssertionError, match="step 6:"):
        assert_every_line_matches(moments["reference"], moments["control"])
