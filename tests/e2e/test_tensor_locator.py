"""The tensor locator end to end: real runs with debug.tensor_fingerprint, each with one kind of divergence
injected, and compare_losses naming the first thing that differs (the decisions themselves: tests/unit)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.divergences import BAD_LOAD_PARAM, BAD_OPTIMIZER_PARAM, BAD_OPTIMIZER_STEP, TRANSPOSED_PARAM
from tests.support.launch import stop_and_resume, together, train
from torchtitan_rng.compare_losses import main as compare_losses

STEPS, STOP_AT = 6, 3
# Two micro-batches a step on one process; one on each of two.
COMMON = ("--lr_scheduler.total_steps", str(STEPS), "--training.global_batch_size", "16", "--debug.tensor_fingerprint",
          "--debug.fingerprint_modules_at_step", "1")
WHOLE = ("--training.steps", str(STEPS))  # stop_and_resume gives its own
SAVES_AT_STOP = ("--checkpoint.enable", "--checkpoint.interval", str(STOP_AT))
Capture = pytest.CaptureFixture[str]
FAULTS = ("--job.custom_module", "tests.support.divergences")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One reference run, an exact stop-and-resume of it (the control), and one run per injected divergence."""
    names = ("reference", "resumed", "data", "kernel", "bad_load", "bad_optimizer", "two_processes", "transposed_load",
             "one_micro_batch", "no_dropout", "other_draws", "seed")
    dumps = {name: tmp_path_factory.mktemp(name) for name in names}
    together(
        # Saving where B stops: its optimizer state is hashed there, and B's loaded state compared with it.
        lambda: train(dumps["reference"], *WHOLE, *COMMON, *SAVES_AT_STOP),
        lambda: stop_and_resume(dumps["resumed"], STOP_AT, STEPS, *COMMON),
        lambda: train(dumps["data"], *WHOLE, *COMMON, "--debug.perturb_rng", "dataloader:0:3"),
        lambda: train(dumps["kernel"], *WHOLE, *COMMON, *FAULTS, "--model.name", "llama_noisy_attention"),
        lambda: stop_and_resume(dumps["bad_load"], STOP_AT, STEPS, *COMMON, *FAULTS, "--model.name", "llama_bad_load"),
        lambda: train(dumps["bad_optimizer"], *WHOLE, *COMMON, *FAULTS, "--model.name", "llama_bad_optimizer"),
        lambda: train(dumps["two_processes"], *WHOLE, *COMMON, nproc=2),
        lambda: stop_and_resume(dumps["transposed_load"], STOP_AT, STEPS, *COMMON, *FAULTS, "--model.name",
                                "llama_transposed_load"),
        lambda: train(dumps["one_micro_batch"], *WHOLE, *COMMON, "--training.local_batch_size", "16"),
        lambda: train(dumps["no_dropout"], *WHOLE, *COMMON, *FAULTS, "--model.name", "llama_no_dropout"),
        lambda: train(dumps["other_draws"], *WHOLE, *COMMON, "--debug.perturb_rng", "torch_cpu:0:1"),
        lambda: train(dumps["seed"], *WHOLE, *COMMON, "--debug.seed", "1"),
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


def test_a_weight_loaded_transposed_is_the_loaded_state(runs: dict[str, Path], capsys: Capture) -> None:
    _, lines = _located(runs, "transposed_load", capsys)  # the same elements in other places: the load, not a kernel
    assert lines == [f"step {STOP_AT + 1}, rank 0: parameter `{TRANSPOSED_PARAM}` entering the step differs, before "
                     "any batch (B resumed here: what the resume loaded differs: the checkpoint or its loading, not "
                     "this step's training)"], lines


def test_another_accumulation_split_is_the_split_not_the_data(runs: dict[str, Path], capsys: Capture) -> None:
    code, lines = _located(runs, "one_micro_batch", capsys)
    # The same 16 samples a step, in the same order: two micro-batches of 8 against one of 16, on one process.
    assert code == 1 and lines[0].startswith("step 1, rank 0: gradient of `"), lines
    assert lines[0].endswith("differs before clipping, the same samples, split as A 2 × 8 against B 1 × 16 "
                             "micro-batches × samples: another split of the step: its sums run in another order, and "
                             "its random draws fall per micro-batch otherwise"), lines


def test_dropout_switched_off_in_the_code_is_named_as_draws(runs: dict[str, Path], capsys: Capture) -> None:
    code, lines = _located(runs, "no_dropout", capsys)
    # The first module whose output differs with its input equal is the first dropout; it drew only in A.
    assert code == 1 and lines == ["step 1, rank 0: `embed_dropout` output differs, its input equal: its random "
                                   "draws differ: it drew random numbers in A and none in B (dropout switched off in "
                                   "B?)"], lines


def test_dropout_drawing_from_another_state_is_named_as_draws(runs: dict[str, Path], capsys: Capture) -> None:
    code, lines = _located(runs, "other_draws", capsys)
    # One extra draw from torch's generator entering step 1: every dropout mask after it differs, no kernel does.
    assert code == 1 and lines == ["step 1, rank 0: `embed_dropout` output differs, its input equal: its random "
                                   "draws differ: the random streams entering it differ (--debug.rng_fingerprint "
                                   "names which)"], lines


def test_fresh_runs_with_another_seed_are_named_by_the_key(runs: dict[str, Path], capsys: Capture) -> None:
    code, lines = _located(runs, "seed", capsys)
    assert code == 1 and lines[0].startswith("step 1, rank 0: parameter `"), lines
    assert lines[0].endswith("entering the step differs, before any batch (neither run resumed here: the initial "
                             "weights differ; the configs differ in debug.seed 0 vs 1)"), lines


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Runs against the module's: an extra draw on rank 1 of two processes, and a resume changing max_norm."""
    dumps = {name: tmp_path_factory.mktemp(name) for name in ("rank_1_draw", "max_norm")}
    resume = ("--checkpoint.enable", "--checkpoint.interval", str(STEPS), *COMMON)
    together(
        lambda: train(dumps["rank_1_draw"], *WHOLE, *COMMON, "--debug.perturb_rng", "torch_cpu:1:3", nproc=2),
        lambda: (train(dumps["max_norm"], "--training.steps", str(STOP_AT), *resume),
                 train(dumps["max_norm"], "--training.steps", str(STEPS), *resume, "--training.max_norm", "0.5",
                       "--checkpoint.allow_config_change", "training.max_norm")),
    )
    return dumps


@pytest.mark.slow
def test_a_divergence_that_starts_on_rank_1_is_named_on_rank_1(runs: dict[str, Path], slow_runs: dict[str, Path],
                                                                capsys: Capture) -> None:
    code, out = _compare(runs["two_processes"], slow_runs["rank_1_draw"], capsys)
    # Rank 1 draws once more entering step 3: its dropout masks, so its loss, differ; after the gradients'
    # reduction every rank's gradients differ, rank 0's first in rank order: the loss names where it began.
    assert code == 1 and ("the first tensor that differs: step 3, rank 1: its loss of micro-batch 0 differs, the "
                          "batches and the weights entering the step equal, the losses of rank 0 equal: the forward "
                          "pass on this rank, before any reduction over the ranks: its random draws") in out, out


@pytest.mark.slow
def test_a_key_changed_at_a_resume_is_named_by_the_key(runs: dict[str, Path], slow_runs: dict[str, Path],
                                                       capsys: Capture) -> None:
    code, out = _compare(runs["reference"], slow_runs["max_norm"], capsys)
    assert code == 1 and (f"step {STOP_AT + 1}, rank 0: gradients equal, parameter `") in out, out
    assert ("after the update differs (the optimizer: its state or its hyperparameters; the configs differ in "
            f"training.max_norm 1.0 → 0.5 (B's resume entering step {STOP_AT + 1}); the optimizer state equal where "
            "last compared, entering this step)") in out, out
