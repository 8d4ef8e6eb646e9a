"""``compare_losses A B --locate`` end to end: real tiny runs with debug.tensor_fingerprint, one of them with a
noisy module (tests/support/divergences.py), their steps replayed on the process count that trained them, and
the module named (the decisions over synthetic fingerprints: tests/unit/test_tensor_locator.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch import launch, stop_and_resume, together, train

pytestmark = pytest.mark.slow

STEPS, STOP_AT = 3, 2
# Checkpoints at step 2 (and the last): the step-3 difference is replayed from step 2's, a step-1 one from the start.
COMMON = ("--checkpoint.enable", "--checkpoint.interval", "2", "--lr_scheduler.total_steps", str(STEPS),
          "--debug.tensor_fingerprint")
FAULTS = ("--job.custom_module", "tests.support.divergences")
NOISY = "layers.0.attn"  # the module divergences.py makes noisy
MODULE_LINE = re.compile(rf"step (\d+), rank (\d+): module (\S+) \(call (\d+) of the step\): (.*)")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """On 1 and 2 processes: a reference, the same stopped at step 2 and resumed (the control), and the same stop
    and resume with the model noisy from its load on (a difference at step 3); on 1 process, a run noisy from its
    start (a difference at step 1, no checkpoint before it)."""
    names = ("reference", "resumed", "noisy_late", "noisy_start", "reference2", "resumed2", "noisy_late2")
    dumps = {name: tmp_path_factory.mktemp(name) for name in names}
    late = (*FAULTS, "--model.name", "llama_noisy_after_load")
    together(
        lambda: train(dumps["reference"], "--training.steps", str(STEPS), *COMMON),
        lambda: stop_and_resume(dumps["resumed"], STOP_AT, STEPS, *COMMON, interval=2),
        lambda: stop_and_resume(dumps["noisy_late"], STOP_AT, STEPS, *COMMON, *late, interval=2),
        lambda: train(dumps["noisy_start"], "--training.steps", str(STEPS), *COMMON, *FAULTS, "--model.name",
                      "llama_noisy_attention"),
        lambda: train(dumps["reference2"], "--training.steps", str(STEPS), *COMMON, nproc=2),
        lambda: stop_and_resume(dumps["resumed2"], STOP_AT, STEPS, *COMMON, interval=2, nproc=2),
        lambda: stop_and_resume(dumps["noisy_late2"], STOP_AT, STEPS, *COMMON, *late, interval=2, nproc=2),
    )
    return dumps


def _compare(a: Path, b: Path, *extra: str, processes: int = 1) -> subprocess.CompletedProcess:
    """compare_losses A B ``extra``, holding the cores its replays use."""
    return launch([sys.executable, "-m", "torchtitan_rng.compare_losses", str(a), str(b), *extra],
                  processes=processes)


def _located(a: Path, b: Path, processes: int = 1) -> tuple[subprocess.CompletedProcess, list[tuple[str, ...]]]:
    """compare_losses A B --locate (the faults' module named): the run, and its module lines as (step, rank,
    module, call, verdict); its exit code is checked against compare_losses' without --locate."""
    done = _compare(a, b, "--locate", *FAULTS, processes=processes)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == _compare(a, b).returncode, done.stdout + done.stderr[-3000:]
    return done, [match.groups() for line in done.stdout.splitlines() if (match := MODULE_LINE.fullmatch(line))]


@pytest.mark.parametrize("processes", [1, 2])
def test_identical_runs_name_nothing(runs: dict[str, Path], processes: int) -> None:
    suffix = "2" if processes == 2 else ""
    done = _compare(runs[f"reference{suffix}"], runs[f"resumed{suffix}"], "--locate", processes=processes)
    assert done.returncode == 0 and done.stdout.splitlines() == [
        f"identical: {STEPS} steps (1..{STEPS}) with bitwise-equal losses",
        "--locate: nothing to replay: every tensor fingerprint equal"], done.stdout + done.stderr[-3000:]


@pytest.mark.parametrize("processes", [1, 2])
def test_the_noisy_module_is_named_from_the_checkpoint_before_the_step(runs: dict[str, Path], processes: int) -> None:
    suffix = "2" if processes == 2 else ""
    a, b = runs[f"reference{suffix}"], runs[f"noisy_late{suffix}"]
    done, modules = _located(a, b, processes)
    lines = done.stdout.splitlines()
    assert f"--locate: replaying step {STOP_AT + 1} of A and B with module hooks" in lines, done.stdout
    for label, run in (("A", a), ("B", b)):
        start = f"replayed {label} on {processes} process(es) from checkpoint {run}/checkpoint/step-{STOP_AT}: "
        assert any(line.startswith(start) for line in lines), done.stdout
    # Each rank names the noisy module, and only it: every call that ended before it gave equal outputs.
    assert [(step, rank, module, verdict) for step, rank, module, _, verdict in modules] == [
        (str(STOP_AT + 1), str(rank), NOISY, "inputs equal, output differs") for rank in range(processes)], done.stdout
    assert len({call for *_, call, _ in modules}) == 1, done.stdout


def test_a_difference_at_step_1_is_located_from_the_runs_start(runs: dict[str, Path]) -> None:
    done, modules = _located(runs["reference"], runs["noisy_start"])
    for label in "AB":
        assert any(line.startswith(f"replayed {label} on 1 process(es) from the start (no checkpoint before it): ")
                   for line in done.stdout.splitlines()), done.stdout
    assert [(step, rank, module, verdict) for step, rank, module, _, verdict in modules] == [
        ("1", "0", NOISY, "inputs equal, output differs")], done.stdout


def test_a_run_of_a_custom_module_not_named_is_refused_in_one_line(runs: dict[str, Path]) -> None:
    done = _compare(runs["reference"], runs["noisy_late"], "--locate")
    checkpoint = runs["noisy_late"] / "checkpoint" / f"step-{STOP_AT}"
    assert "replaying" not in done.stdout  # refused before either replay was launched
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"error: --locate cannot rebuild B ({runs['noisy_late']}): checkpoint {checkpoint} was trained with "
        "job.custom_module 'tests.support.divergences', code that is imported only when you name it: pass "
        "--job.custom_module tests.support.divergences if you trust it"], done.stderr[-3000:]
