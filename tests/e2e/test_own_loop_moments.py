"""A stop signal at every moment of an ExactResume loop (tests/support/own_loop_stop.py: one process, 2 loader
workers, a save every 2 steps, checkpoints signed with a key) ends it with a complete checkpoint at the step it
agreed on, and exit 0. One run is stopped again and again, each time at another moment, each SIGTERM sent to
the whole process group (loader workers included) while the loop holds at a fault-injection point; resumed,
its loss log is bit for bit the uninterrupted run's. ``ExactResume`` saves synchronously only (no async
moment).

    moment                                      the loop ends with
    before the first step                       step-1 (the first step runs, then it saves and stops)
    data loading (both workers in __getitem__)  step-2
    a step (the loop signals its own group)     step-3
    the sync save of step 4                     step-4
    the final save (step 8)                     step-8

Then the signature: a checkpoint whose weights and ``checksums.json`` were both rewritten is refused naming the
file; a key named but not set is refused before anything is built.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.checks import assert_every_line_matches
from tests.support.held import Held, start_held
from tests.support.launch import REPO, run_env, together
from torchtitan_rng.checkpoint.integrity import CHECKSUMS_NAME, write_checksums
from torchtitan_rng.checkpoint.layout import complete_steps
from torchtitan_rng.errors import CheckpointError

STEPS = 8
KEY_ENV = "OWN_LOOP_TEST_KEY"
KEY = {KEY_ENV: "a secret of the test"}
LOOP = [sys.executable, "-m", "tests.support.own_loop_stop"]


def _args(out: Path, *extra: str) -> list[str]:
    return [*LOOP, str(out), str(STEPS), "--interval", "2", "--signing-key-env", KEY_ENV, *extra]


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(_args(out, *extra), cwd=REPO, capture_output=True, text=True, timeout=300, env=run_env(KEY),
                          start_new_session=True)


def _held(out: Path, name: str, holds: list[str], *extra: str) -> Held:
    return start_held(_args(out, *extra), out.parent / name, ";".join(f"{hold}:0:hold" for hold in holds), KEY)


def _signal_at(job: Held, held: list[Path], signum: int) -> None:
    """``signum`` to the loop's whole process group (its loader workers included) while it holds at ``held``,
    then let it go on."""
    os.killpg(job.proc.pid, signum)
    for file in held:
        file.unlink()


@pytest.fixture(scope="module")
def moments(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("own_moments")
    reference, run, control = root / "reference", root / "run", root / "control"
    for out in (reference, run, control):
        out.mkdir()
    results: dict = {}

    def after(proc: subprocess.CompletedProcess) -> tuple[subprocess.CompletedProcess, list[int], str]:
        """The run's end: its output, the complete checkpoints then, and the loop's last exit line."""
        return proc, complete_steps(run / "checkpoint"), (run / "exits").read_text().splitlines()[-1]

    def stopped_again_and_again() -> None:
        job = _held(run, "first", ["before_step:1"])
        _signal_at(job, [job.wait_held("before_step-1-rank0")], signal.SIGTERM)
        results["first"] = after(job.finish())

        # Both workers hold at their first sample: no batch is ready, and the resumed loop waits for the ones it
        # redoes since the loader's last snapshot (in iter()) or for step 2's; then the signal comes.
        job = _held(run, "data", ["data_loading:0"])
        _signal_at(job, job.wait_all_held("data_loading-0-rank0-worker*", 2), signal.SIGTERM)
        results["data"] = after(job.finish())

        results["step"] = after(_run(run, "--signal-at", "3"))
        # The control beside the rest: this checkpoint resumed without restore_rng().
        shutil.copy(run / "loss_log.jsonl", control / "loss_log.jsonl")
        shutil.copytree(run / "checkpoint" / "step-3", control / "checkpoint" / "step-3")

        def save_and_final() -> None:
            job = _held(run, "save", ["save_writing:4"])
            _signal_at(job, [job.wait_held("save_writing-4-rank0")], signal.SIGTERM)
            results["save"] = after(job.finish())
            job = _held(run, "final", [f"save_writing:{STEPS}"])
            _signal_at(job, [job.wait_held(f"save_writing-{STEPS}-rank0")], signal.SIGTERM)
            results["final"] = after(job.finish())

        together(save_and_final, lambda: _run(control, "--no-restore"))

    together(lambda: _run(reference), stopped_again_and_again)
    results.update(reference=reference, run=run, control=control)
    return results


def _stopped_cleanly(moments: dict, name: str, step: int, steps: list[int]) -> None:
    proc, complete, exit_line = moments[name]
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert (exit_line, complete) == (f"rank 0 left the loop after step {step}", steps)


def test_signal_before_the_first_step_saves_that_step(moments: dict) -> None:
    _stopped_cleanly(moments, "first", 1, [1])


def test_signal_during_data_loading_saves_the_step_waiting_for_it(moments: dict) -> None:
    _stopped_cleanly(moments, "data", 2, [1, 2])


def test_signal_during_a_step_saves_it(moments: dict) -> None:
    _stopped_cleanly(moments, "step", 3, [1, 2, 3])


def test_signal_during_a_save_stops_at_that_step(moments: dict) -> None:
    _stopped_cleanly(moments, "save", 4, [1, 2, 3, 4])


def test_signal_during_the_final_save_finishes_it(moments: dict) -> None:
    _stopped_cleanly(moments, "final", STEPS, [1, 2, 3, 4, 6, STEPS])


def test_log_after_all_stops_equals_uninterrupted(moments: dict) -> None:
    assert_every_line_matches(moments["reference"], moments["run"])
    # Control: the same resume without restore_rng() (other dropout masks) is caught at its first step.
    with pytest.raises(AssertionError, match="step 4:"):
        assert_every_line_matches(moments["reference"], moments["control"])


def test_a_tampered_checkpoint_is_refused_naming_the_file(moments: dict, tmp_path: Path) -> None:
    """Whoever can write the folder but lacks the key scales a weight and rewrites checksums.json to match."""
    checkpoint = tmp_path / "checkpoint" / f"step-{STEPS}"
    shutil.copytree(moments["run"] / "checkpoint" / f"step-{STEPS}", checkpoint)
    shard = next(checkpoint.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    weight = torch.tensor(1.5).numpy().tobytes()
    data[len(data) // 2:len(data) // 2 + len(weight)] = weight
    shard.write_bytes(bytes(data))
    signed = json.loads((checkpoint / CHECKSUMS_NAME).read_text())
    write_checksums(checkpoint)  # the sums of the changed file, as an attacker would recompute them
    assert json.loads((checkpoint / CHECKSUMS_NAME).read_text()) != signed
    proc = subprocess.run([*LOOP, str(tmp_path), str(STEPS + 2), "--signing-key-env", KEY_ENV], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=run_env(KEY), start_new_session=True)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert proc.stderr.strip() == (
        f"error: checkpoint {checkpoint} is refused: {CHECKSUMS_NAME} does not match its signature under the key "
        f"in ${KEY_ENV} (changed after the save, or signed with another key); it may have been tampered with: "
        "resume from a checkpoint signed with this key (load_step=), or check the key")
    assert not (tmp_path / "loss_log.jsonl").exists()  # refused before a step ran


def test_a_named_key_that_is_not_set_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchtitan_rng import ExactResume

    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(CheckpointError, match=rf"signed with the key in \${KEY_ENV}, but \${KEY_ENV} is not set"):
        ExactResume(tmp_path / "checkpoint", model=torch.nn.Linear(2, 2), interval=1, signing_key_env=KEY_ENV)
    assert not (tmp_path / "checkpoint").exists()
