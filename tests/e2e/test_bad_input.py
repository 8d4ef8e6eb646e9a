"""Bad input on the command line — config keys and values, a missing config file, a loss log that is not
JSONL: one line saying what is wrong and what to do, exit 2, no traceback, nothing of the user's touched."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.checks import assert_refused, snapshot
from tests.support.launch import compare, train


# --- configuration (run_train.sh: the launcher refuses before any rank starts) ----------------------------

CONFIG_CASES = {
    "unknown key": (("--training.stepz", "3"), ("unknown config key 'training.stepz'", "valid keys in [training]")),
    "unknown section": (("--trainin.steps", "3"), ("unknown config section 'trainin'", "valid sections")),
    "wrong type": (("--training.steps", "many"), ("training.steps", "expected an integer")),
    "steps <= 0": (("--training.steps", "0"), ("training.steps = 0 is out of range", ">= 1")),
    "interval <= 0": (("--checkpoint.interval", "-5"), ("checkpoint.interval = -5 is out of range",)),
    "keep 1 while async": (("--checkpoint.keep_latest_k", "1", "--checkpoint.async_mode", "async"),
                           ("keep_latest_k = 1 cannot be used", "async")),
    "unknown signal": (("--signals.checkpoint_on", "SIGTERM,SIGKILL"), ("signals.checkpoint_on has 'SIGKILL'",)),
    "load_step missing": (("--checkpoint.enable", "--checkpoint.load_step", "7"),
                          ("checkpoint.load_step 7 not found", "complete checkpoints there: 2")),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_bad_config_is_one_line(user_dump: Path, case: str) -> None:
    overrides, fragments = CONFIG_CASES[case]
    before = snapshot(user_dump)
    assert_refused(train(user_dump, *overrides, check=False), *fragments)
    assert snapshot(user_dump) == before


def test_missing_config_file(user_dump: Path) -> None:
    before = snapshot(user_dump)
    assert_refused(train(user_dump, config="does_not_exist", check=False), "does_not_exist.toml' does not exist")
    assert snapshot(user_dump) == before


def test_bad_config_through_the_launcher(user_dump: Path) -> None:
    """The same refusal from the launcher, before torchrun starts any rank."""
    before = snapshot(user_dump)
    proc = train(user_dump, "--training.steps", "0", nproc=2, check=False)
    assert_refused(proc, "training.steps = 0 is out of range")
    assert "rank" not in proc.stdout.lower() and snapshot(user_dump) == before


LAYOUT_CASES = {
    "degrees do not make the process count": (2, ("--parallelism.tensor_parallel_degree", "2",
                                                  "--parallelism.data_parallel_shard_degree", "2"),
                                              "data_parallel_shard_degree = 2 x tensor_parallel_degree = 2 is 4 "
                                              "processes, but 2 were started"),
    "tp does not divide the heads": (3, ("--parallelism.tensor_parallel_degree", "3"),
                                     "llama flavor 'debug' has 4 attention heads (and key/value heads), which 3 "
                                     "ranks do not split evenly"),
    "tp does not divide the hidden size": (3, ("--parallelism.tensor_parallel_degree", "3", "--model.flavor",
                                               "bench"), "llama flavor 'bench' has 2048 MLP hidden units, which 3 "
                                                         "ranks do not split evenly"),
    "flux does not split": (2, ("--parallelism.tensor_parallel_degree", "2", "--model.name", "flux"),
                            "model 'flux' does not split over tensor-parallel ranks (its single-stream blocks"),
    "invariant: tp does not divide the chunks": (3, ("--parallelism.world_size_invariant", "--training.global_batch_size",
                                                     "24", "--parallelism.tensor_parallel_degree", "3"),
                                                 "parallelism.tensor_parallel_degree = 3 does not divide "
                                                 "parallelism.tensor_parallel_chunks = 4"),
    "invariant: the chunks do not divide the heads": (2, ("--parallelism.world_size_invariant",
                                                          "--training.global_batch_size", "16",
                                                          "--parallelism.tensor_parallel_chunks", "8"),
                                                      "tensor_parallel_chunks = 8 does not divide the model's 4 "
                                                      "attention heads"),
}


@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_a_layout_that_cannot_run_is_refused_by_the_launcher(user_dump: Path, case: str) -> None:
    """Tensor-parallel degrees: one line from the launcher, before torchrun starts any rank."""
    nproc, overrides, fragment = LAYOUT_CASES[case]
    before = snapshot(user_dump)
    proc = train(user_dump, *overrides, nproc=nproc, check=False)
    assert_refused(proc, fragment)
    assert "rank" not in proc.stdout.lower() and snapshot(user_dump) == before


def test_compare_losses_on_a_log_that_is_not_jsonl(tmp_path: Path, saved: Path) -> None:
    bad = tmp_path / "loss_log.jsonl"
    bad.write_text('{"step": 1, "loss": 2.5}\nnot json at all\n')
    before = bad.read_bytes()
    assert_refused(compare(saved, bad), f"{bad}:2: not a loss-log line")
    assert bad.read_bytes() == before
