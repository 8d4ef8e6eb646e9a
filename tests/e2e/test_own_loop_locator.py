"""The tensor locator in an own loop (ExactResume(..., tensor_fingerprint=True)): real runs of
tests/support/own_loop_prints.py, one fault each, and compare_losses naming the first thing that differs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.launch import REPO, launch, run_env, together
from torchtitan_rng.compare_losses import main as compare_losses

# The slow tier (CI): the everyday suite stays within its time on 2 cores.
pytestmark = pytest.mark.slow

SCRIPT = str(REPO / "tests" / "support" / "own_loop_prints.py")
STEPS, STOP_AT = 6, 3
Capture = pytest.CaptureFixture[str]


def _run(out: Path, steps: int, *extra: str, nproc: int = 1) -> None:
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    proc = launch([*launcher, SCRIPT, "--out", str(out), "--steps", str(steps), *extra], env=run_env(),
                  processes=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def _stopped(out: Path, *resume_extra: str, nproc: int = 1) -> None:
    _run(out, STOP_AT, nproc=nproc)
    _run(out, STEPS, *resume_extra, nproc=nproc)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    names = ("reference", "resumed", "skipped", "noisy", "max_norm", "reference_2", "resumed_2")
    dumps = {name: tmp_path_factory.mktemp(name) for name in names}
    together(
        lambda: _run(dumps["reference"], STEPS),
        lambda: _stopped(dumps["resumed"]),
        lambda: _run(dumps["skipped"], STEPS, "--skip-batch-at", "3"),
        lambda: _run(dumps["noisy"], STEPS, "--noisy"),
        lambda: _stopped(dumps["max_norm"], "--max-norm", "0.01"),  # allowed at the resume: allow_changes
        lambda: _run(dumps["reference_2"], STEPS, nproc=2),
        lambda: _stopped(dumps["resumed_2"], nproc=2),
    )
    return dumps


def _located(a: Path, b: Path, capsys: Capture) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = compare_losses([str(a), str(b)])
    lead = "the first tensor that differs: "
    return code, [line[len(lead):] for line in capsys.readouterr().out.splitlines() if line.startswith(lead)]


@pytest.mark.parametrize("processes", [1, 2])
def test_control_an_exact_resume_names_nothing(runs: dict[str, Path], capsys: Capture, processes: int) -> None:
    suffix = "_2" if processes == 2 else ""
    capsys.readouterr()
    assert compare_losses([str(runs["reference" + suffix]), str(runs["resumed" + suffix])]) == 0
    assert capsys.readouterr().out.splitlines() == [f"identical: {STEPS} steps (1..{STEPS}) with bitwise-equal losses"]
    assert (runs["resumed" + suffix] / "tensor_fingerprints" / f"rank{processes - 1}.jsonl").is_file()


def test_a_skipped_batch_is_the_data(runs: dict[str, Path], capsys: Capture) -> None:
    code, lines = _located(runs["reference"], runs["skipped"], capsys)
    assert code == 1 and lines == ["step 3, rank 0: the batch of micro-batch 0 differs (`0`, sample(s) 0, 1, 2, 3 of "
                                   "it): the data, not the model"], lines


def test_a_noisy_module_is_named_at_its_output(runs: dict[str, Path], capsys: Capture) -> None:
    code, lines = _located(runs["reference"], runs["noisy"], capsys)
    assert code == 1 and lines == ["step 1, rank 0: `0` output differs, its input equal (a kernel: an operation "
                                   "inside it gave other bits; its parameters entered the step equal)"], lines


def test_max_norm_changed_at_the_resume_is_the_update(runs: dict[str, Path], capsys: Capture) -> None:
    capsys.readouterr()
    compare_losses([str(runs["reference"]), str(runs["max_norm"])])
    # ExactResume has no stream-fingerprint option: the trainer's is not advised.
    assert ("no RNG fingerprints in A and B: ExactResume and the HF Trainer and Lightning integrations record "
            "none (--debug.rng_fingerprint is the trainer's option); their tensor fingerprints say what differs"
            ) in capsys.readouterr().out
    code, lines = _located(runs["reference"], runs["max_norm"], capsys)
    assert code == 1 and lines == [
        f"step {STOP_AT + 1}, rank 0: gradients equal, parameter `0.weight` after the update differs (the optimizer: "
        f"its state or its hyperparameters; the configs differ in config.max_norm 0.05 → 0.01 (B's resume entering "
        f"step {STOP_AT + 1}); the optimizer state B's resume loaded not compared: A hashed none after step {STOP_AT} "
        "(it is hashed where a process starts and at saves))"], lines
