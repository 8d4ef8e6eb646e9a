"""training.skip_steps without training: its spelling (one-line refusals, exit 2), its policy at a resume (named,
not refused; refused for steps the checkpoint already trained)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checks import assert_refused
from tests.support.launch import REPO, run_env
from torchtitan_rng import resume, skips
from torchtitan_rng.checkpoint import run_record
from torchtitan_rng.config import ConfigError, parse_args, parse_skip_steps

CONFIG = str(REPO / "train_configs" / "llama_debug.toml")


def _record(*overrides: str) -> dict:
    return resume.build_record(parse_args(["--job.config_file", CONFIG, *overrides]), range(64))


@pytest.mark.parametrize(("value", "steps"), [("", set()), ("6,9", {6, 9}), ("40-43", {40, 41, 42, 43}),
                                              (" 9, 6-7 ,", {6, 7, 9}), ("3-3", {3})])
def test_steps_and_ranges(value: str, steps: set[int]) -> None:
    assert parse_skip_steps(value) == steps


def test_the_record_compares_steps_not_spelling() -> None:
    assert skips.canonical("9,7,6") == skips.canonical("6-7,9") == "6-7,9"
    assert run_record.differences(_record("--training.skip_steps", "9,6,7"), _record("--training.skip_steps", "6-7,9")) == []


@pytest.mark.parametrize("value", ["x", "0", "5-3", "1-", "-3", "6;9", "2.5"])
def test_bad_values_are_one_line(value: str) -> None:
    with pytest.raises(ConfigError, match=r"training.skip_steps = .* is not valid .* e\.g\. 6,9,40-43") as err:
        parse_args(["--training.skip_steps", value])
    assert "\n" not in str(err.value)


def test_bad_value_exits_2_before_training(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "torchtitan_rng.train", "--job.config_file", CONFIG,
                           "--job.dump_folder", str(tmp_path / "run"), "--training.skip_steps", "5-3"],
                          cwd=tmp_path, capture_output=True, text=True, env=run_env(), timeout=120)
    assert_refused(proc, "training.skip_steps = '5-3' is not valid")
    assert list(tmp_path.iterdir()) == []


def test_a_skip_added_at_a_resume_is_named_not_refused(tmp_path: Path) -> None:
    saved, resumed = _record(), _record("--training.skip_steps", "6")
    warnings = run_record.check_resume(tmp_path, saved, resumed, allowed=[])
    assert [line for line in warnings if line.startswith("note: training.skip_steps = '6'")], warnings
    # Control: a trajectory key changed the same way is refused.
    with pytest.raises(run_record.ConfigDriftError, match="optimizer.lr"):
        run_record.check_resume(tmp_path, saved, _record("--optimizer.lr", "0.5"), allowed=[])


def test_a_skip_added_for_a_trained_step_is_refused(tmp_path: Path) -> None:
    config = parse_args(["--job.config_file", CONFIG, "--training.skip_steps", "2,6"])
    with pytest.raises(ConfigError, match=r"adds step\(s\) 2, which checkpoint .* \(step 3\) has already trained"):
        skips.refuse_past_steps(config.training, _record(), tmp_path, 3)
    skips.refuse_past_steps(config.training, _record("--training.skip_steps", "2"), tmp_path, 3)  # skipped then already
    skips.refuse_past_steps(config.training, _record(), tmp_path, 1)  # both still ahead


@pytest.mark.parametrize("invariant", [False, True])
def test_step_sample_keys_follow_the_samplers_of_every_rank(invariant: bool) -> None:
    """What ``python -m torchtitan_rng.samples`` computes for 2 processes, 2 micro-batches each, 3 samples per
    micro-batch over 10 samples per epoch (batches span epochs), is what each rank's own sampler hands out, placed
    by the plan's slot (as the loss log places them)."""
    import torch

    from torchtitan_rng.data.global_sampler import GlobalBatchSampler
    from torchtitan_rng.data.sampler import ResumableBatchSampler
    from torchtitan_rng.parallel import mode_of
    from torchtitan_rng.sample_log import in_slot_order

    flags = ["--training.local_batch_size", "3", "--training.global_batch_size", "12", "--debug.seed", "7"]
    config = parse_args([*flags, *(["--parallelism.world_size_invariant"] if invariant else [])])
    samplers = [GlobalBatchSampler(10, 3, 4, rank, 2, 7) if invariant else ResumableBatchSampler(10, 3, rank, 2, 7)
                for rank in range(2)]
    slot = mode_of(config.parallelism).numerics(config, (0, 2), torch.device("cpu")).slot
    for step in range(1, 9):
        loaded = in_slot_order([(rank, [next(sampler) for _ in range(2)]) for rank, sampler in enumerate(samplers)],
                               slot)
        assert mode_of(config.parallelism).step_sample_keys(config, 10, 2, step) == loaded, step
    # Control: another seed orders them otherwise.
    other = parse_args([*flags[:-1], "8", *(["--parallelism.world_size_invariant"] if invariant else [])])
    assert mode_of(other.parallelism).step_sample_keys(other, 10, 2, 8) != loaded


def test_a_huge_range_stays_a_range() -> None:
    """``1-100000000`` is one range: membership, the record's spelling and the resume's check work on it without
    a set of every step (before: a hundred million ints, a MemoryError after 20 s)."""
    steps = parse_skip_steps("1-100000000,200000000")
    assert steps.ranges == ((1, 100000000), (200000000, 200000000)) and len(steps) == 100000001
    assert 1 in steps and 100000000 in steps and 100000001 not in steps and 200000000 in steps and 0 not in steps
    assert skips.canonical("200000000,1-100000000") == "1-100000000,200000000"
    config = parse_args(["--job.config_file", CONFIG, "--training.skip_steps", "1-100000000"])
    assert 77 in skips.skipped_steps(config.training)
    with pytest.raises(ConfigError, match=r"adds step\(s\) 1-2,4-5, which checkpoint .* \(step 5\) has already"):
        skips.refuse_past_steps(config.training, _record("--training.skip_steps", "3"), Path("ckpt"), 5)
    skips.refuse_past_steps(config.training, _record("--training.skip_steps", "1-100000000"), Path("ckpt"), 5)


def test_a_huge_spike_guard_window_is_refused_in_one_line() -> None:
    """The window is allocated up front (before: 8 TB asked of the allocator, a traceback); the bound is named.
    Control: the largest window is accepted."""
    with pytest.raises(ConfigError, match=r"window=1000000000000 is above the largest window, 10000 trained steps"
                       ) as err:
        parse_args(["--training.spike_guard", "loss,factor=3,window=1000000000000", "--metrics.log_samples"])
    assert "\n" not in str(err.value)
    config = parse_args(["--training.spike_guard", "loss,factor=3,window=10000", "--metrics.log_samples"])
    assert config.training.spike_guard.endswith("window=10000")


def test_huge_inputs_exit_2_before_training(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "torchtitan_rng.train", "--job.config_file", CONFIG,
                           "--job.dump_folder", str(tmp_path / "run"), "--training.skip_steps", "1-100000000",
                           "--metrics.log_samples", "--training.spike_guard", "loss,factor=3,window=1000000000000"],
                          cwd=tmp_path, capture_output=True, text=True, env=run_env(), timeout=120)
    assert_refused(proc, "window=1000000000000 is above the largest window, 10000 trained steps")
    assert list(tmp_path.iterdir()) == []
