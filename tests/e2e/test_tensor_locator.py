"""The tensor locator end to end: real runs with debug.tensor_fingerprint, each with one kind of divergence
injected, and compare_losses naming the first thing that differs (the decisions themselves: tests/unit)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.divergences import BAD_LOAD_PARAM, BAD_OPTIMIZER_PARAM, BAD_OPTIMIZER_STEP
from tests.support.launch import stop_and_resume, together, train
from torchtitan_rng.compare_losses import main as compare_losses

STEPS, STOP_AT = 6, 3
# Two micro-batches a step on one process; one on each of two.
COMMON = ("--lr_scheduler.total_steps", str(STEPS), "--training.global_batch_size", "16", "--debug.tensor_fingerprint",
          "--debug.fingerprint_modules_at_step", "1")
WHOLE = ("--training.steps", str(STEPS))  # stop_and_resume gives its own
Capture = pytest.CaptureFixture[str]
FAULTS = ("--job.custom_module", "tests.support.divergences")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One reference run, an exact stop-and-resume of it (the control), and one run per injected divergence."""
    names = ("reference", "resumed", "data", "kernel", "bad_load", "bad_optimizer", "two_processes")
    dumps = {name: tmp_path_factory.mktemp(name) for name in names}
    together(
        lambda: train(dumps["reference"], *WHOLE, *COMMON),
        lambda: stop_and_resume(dumps["resumed"], STOP_AT, STEPS, *COMMON),
        lambda: train(dumps["data"], *WHOLE, *COMMON, "--debug.perturb_rng", "dataloader:0:3"),
        lambda: train(dumps["kernel"], *WHOLE, *COMMON, *FAULTS, "--model.name", "llama_noisy_attention"),
        lambda: stop_and_resume(dumps["bad_load"], STOP_AT, STEPS, *COMMON, *FAULTS, "--model.name", "llama_bad_load"),
        lambda: train(dumps["bad_optimizer"], *WHOLE, *COMMON, *FAULTS, "--model.name", "llama_bad_optimizer"),
        lambda: train(dumps["two_processes"], *WHOLE, *COMMON, nproc=2),
    )
    return dumps


def _compare(a: Path, b: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """compare_losses A B, in this process (no launch to wait for): its exit code and output."""
    capsys.readouterr()
    code = compare_losses([str(a), str(b)])
    return code, capsys.readouterr().out


def _located(runs: dict[str, Path], name: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """compare_losses reference NAME: its exit code and what the tensor locator says (after its lead-in: a loss
    may differ from the first differing step on, or not at all where the difference is small)."""
    code, out = _compare(runs["reference"], runs[name], capsys)
    lead = "the first tensor that differs: "
    return code, [line[line.index(lead) + len(lead):] for line in out.splitlines() if lead in line]


def test_control_nothing_differs_nothing_is_named(runs: dict[str, Path], capsys: Capture) -> None:
    code, out = _compare(runs["reference"], runs["resumed"], capsys)
    assert code == 0 and out.splitlines() == [f"identical: {STEPS} steps (1..{STEPS}) with bitwise-equal losses"], out


def test_a_data_order_change_is_the_data(runs: dict[str, Path], capsys: Capture) -> None:
    code, lines = _located(runs, "data", capsys)
    # One batch skipped entering step 3: its first micro-batch is what the second one would have been.
    assert code == 1 and lines[0].startswith("step 3, rank 0: the batch of micro-batch 0 differs"), lines
    assert lines[0].endswith("the data, not the model"), lines


def test_a_non_deterministic_op_is_named_at_its_module(runs: dict[str, Path], capsys: Capture) -> None:
    code, lines = _located(runs, "kernel", capsys)
    # Named at step 1, where the losses still agree: the noise is below the loss's last bit there.
    assert code == 1 and lines == ["step 1, rank 0: `layers.0.attn` output differs, its input equal (a kernel: an "
                                   "operation inside it gave other bits; its parameters entered the step equal)"], lines


def test_a_parameter_perturbed_at_the_resume_is_the_loaded_state(runs: dict[str, Path], capsys: Capture) -> None:
    _, lines = _located(runs, "bad_load", capsys)  # one ulp of one weight: the losses may not show it at all
    assert lines == [f"step {STOP_AT + 1}, rank 0: parameter `{BAD_LOAD_PARAM}` entering the step differs, before any "
                     "batch (B resumed here: what the resume loaded differs: the checkpoint or its loading, not this "
                     "step's training)"], lines


def test_an_optimizer_state_corruption_is_the_optimizer(runs: dict[str, Path], capsys: Capture) -> None:
    code, lines = _located(runs, "bad_optimizer", capsys)
    assert code == 1 and lines[0].startswith(f"step {BAD_OPTIMIZER_STEP}, rank 0: gradients equal, parameter "
                                             f"`{BAD_OPTIMIZER_PARAM}` after the update differs (the optimizer"), lines


def test_another_process_count_is_the_reduction(runs: dict[str, Path], capsys: Capture) -> None:
    code, lines = _located(runs, "two_processes", capsys)
    # The same 16 samples a step, two micro-batches on one process against one on each of two.
    assert code == 1 and lines[0].startswith("step 1: gradient of `"), lines
    assert "the same samples: summed over 1 against 2 processes" in lines[0], lines
