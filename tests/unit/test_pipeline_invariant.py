"""The world-size-invariant mode under pipeline parallelism, its pieces without training: which plan a config
gets and what it refuses (one line each), the layout keys a resume may change in this mode only, each block's
streams keyed by (step, micro-batch, layer) wherever the block runs, and activation checkpointing replaying
them. (Training with stages: tests/e2e/test_pipeline_invariant.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from tests.support.launch import REPO
from torchtitan_rng import resume
from torchtitan_rng.checkpoint import run_record
from torchtitan_rng.config import ConfigError, JobConfig, parse_args
from torchtitan_rng.parallel import Mode, mode_of
from torchtitan_rng.parallel.invariant.numerics import DerivedNumerics
from torchtitan_rng.parallel.invariant.streams import MicroBatchStreams
from torchtitan_rng.parallel.layout import FlatLayout
from torchtitan_rng.parallel.pipeline import StagedLayout, describe_stages, stage_layers

CONFIG = str(REPO / "train_configs" / "llama_debug.toml")
# Four micro-batches of 2 per step.
INVARIANT = ("--parallelism.world_size_invariant", "--training.local_batch_size", "2",
             "--training.global_batch_size", "8")


def _config(*overrides: str) -> JobConfig:
    return parse_args(["--job.config_file", CONFIG, *overrides])


def _pp2(schedule: str = "1F1B", *overrides: str) -> JobConfig:
    return _config(*INVARIANT, "--parallelism.pipeline_parallel_degree", "2",
                   "--parallelism.pipeline_parallel_microbatch_size", "2",
                   "--parallelism.pipeline_parallel_schedule", schedule, *overrides)


INVARIANT_PIPELINE, INVARIANT_FLAT = Mode(StagedLayout, DerivedNumerics), Mode(FlatLayout, DerivedNumerics)


def test_the_plan_with_stages_in_the_invariant_mode() -> None:
    assert mode_of(_pp2().parallelism) == INVARIANT_PIPELINE
    assert mode_of(_config(*INVARIANT).parallelism) == INVARIANT_FLAT


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B"])
def test_schedules_that_backpropagate_whole_micro_batches_are_accepted(schedule: str) -> None:
    INVARIANT_PIPELINE.check_config(_pp2(schedule, "--model.flavor", "debug4"), 4)


@pytest.mark.parametrize(("config", "world_size", "fragment"), [
    (_pp2("ZBVZeroBubble"), 2, "'ZBVZeroBubble' computes each micro-batch's weight gradient in a separate pass"),
    (_pp2("InterleavedZeroBubble"), 2, "'InterleavedZeroBubble' computes each micro-batch's weight gradient"),
    (_pp2("LoopedBFS"), 2, "'LoopedBFS' runs a stage's backwards in reverse micro-batch order"),
    (_pp2("1F1B", "--parallelism.pipeline_parallel_microbatch_size", "1"), 2, "pipeline_parallel_microbatch_size "
     "= 1 must be training.local_batch_size = 2"),
    (_pp2(), 6, "needs a number of data-parallel ranks (processes / pipeline_parallel_degree) that "
     "divides the 4 micro-batches per step (global / local batch size); got 3 data-parallel ranks"),
    (_pp2(), 3, "does not divide the 3 processes started"),
])
def test_what_cannot_be_invariant_is_refused_in_one_line(config: JobConfig, world_size: int, fragment: str) -> None:
    with pytest.raises(ConfigError) as refused:
        INVARIANT_PIPELINE.check_config(config, world_size)
    assert "\n" not in str(refused.value) and fragment in str(refused.value), str(refused.value)


def test_an_unset_micro_batch_size_is_the_local_batch_size_in_this_mode() -> None:
    """Stages without --parallelism.pipeline_parallel_microbatch_size: the mode runs (and records, and prints) its
    micro-batch, training.local_batch_size; the ordinary mode resolves the same unset key to 1."""
    config = _config(*INVARIANT, "--parallelism.pipeline_parallel_degree", "2")
    assert config.parallelism.pipeline_parallel_microbatch_size == 0  # unset
    INVARIANT_PIPELINE.check_config(config, 2)
    assert resume.resolved(config)["parallelism.pipeline_parallel_microbatch_size"] == 2
    assert describe_stages(config.parallelism, config.training, DerivedNumerics, 1,
                           stage_layers(config.parallelism, 2)) == (
        "pipeline: pp 2 x dp 1, schedule 1F1B, 2 stages (layers 0 | 1); micro-batches of 2 sample(s), 1 per loader "
        "batch; parallelism.pipeline_parallel_microbatch_size unset: training.local_batch_size, this mode's "
        "micro-batch")
    ordinary = _config("--training.local_batch_size", "2", "--parallelism.pipeline_parallel_degree", "2")
    assert resume.resolved(ordinary)["parallelism.pipeline_parallel_microbatch_size"] == 1


class _Samples:
    def __len__(self) -> int:
        return 64


def test_a_layout_change_at_resume_is_quiet_in_the_invariant_mode_only() -> None:
    """A pp 2 x 1F1B checkpoint resumed by one process without stages: no key differs for the invariant plan;
    control: the same change is a refused key for the ordinary plan (the degree: the stage keys mean nothing
    without stages, so the micro-batch size is not named)."""
    saved = resume.build_record(_pp2(), _Samples())
    one_process = resume.build_record(_config(*INVARIANT), _Samples())
    invariant = resume.compared_by(_config(*INVARIANT))
    assert run_record.differences(saved, one_process, invariant) == []
    assert run_record.check_resume(Path("ckpt/step-2"), saved, one_process, [], compared=invariant) == []
    ordinary = resume.compared_by(_config())
    changed = [change.key for change in run_record.differences(saved, one_process, ordinary)]
    assert changed == ["parallelism.pipeline_parallel_degree"]


def test_sample_keys_of_a_step_are_its_slots_at_any_layout() -> None:
    """pp 2 x dp 2, two processes without stages and one: the step's four micro-batches by slot, each once (column
    0 runs slots 0 and 2, column 1 slots 1 and 3, and the plan numbers them so)."""
    config = _pp2()
    one = INVARIANT_FLAT.step_sample_keys(config, 64, 1, 3)
    assert len(one) == 4 and len({tuple(keys) for keys in one}) == 4
    assert INVARIANT_PIPELINE.step_sample_keys(config, 64, 4, 3) == INVARIANT_FLAT.step_sample_keys(config, 64, 2, 3) \
        == one
    numerics = DerivedNumerics(config, (0, 2), torch.device("cpu"))
    assert [numerics.slot(shard, index) for shard in (0, 1) for index in (0, 1)] == [0, 2, 1, 3]


def _bits(tensor: torch.Tensor) -> list[int]:
    return tensor.detach().view(torch.int32).tolist()


class _Noise(nn.Module):
    """A block whose output is its input under a dropout mask."""

    def __init__(self) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(x)


def _masks_of_last_block(hooked: bool, whole_model: bool) -> torch.Tensor:
    """Block 2 of three under micro-batch (step 5, slot 3): after blocks 0 and 1 (one process), or alone after
    another micro-batch's blocks (a stage starting at layer 2)."""
    blocks = nn.ModuleList(_Noise() for _ in range(3)).train()
    streams = MicroBatchStreams(seed=11)
    if hooked:
        streams.hook_blocks([blocks])
    if whole_model:
        streams.enter(5, 3)
        blocks[1](blocks[0](torch.ones(64)))
    else:
        streams.enter(5, 1)  # another micro-batch ran on this rank before
        blocks[0](torch.ones(64))
        streams.enter(5, 3)
    return blocks[2](torch.ones(64))


def test_a_block_draws_the_same_masks_whichever_stage_runs_it() -> None:
    assert _bits(_masks_of_last_block(True, True)) == _bits(_masks_of_last_block(True, False))
    # Control: without the per-layer seed, the block draws on from whatever ran before it.
    assert _bits(_masks_of_last_block(False, True)) != _bits(_masks_of_last_block(False, False))


def _recomputed_grad(hook_outside: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpointed block's forward under micro-batch 0, another micro-batch's forward, then its backward
    (as a pipeline schedule interleaves them): (the input's gradient, 2 x the forward's mask)."""
    block = _Noise().train()
    wrapped = checkpoint_wrapper(block, preserve_rng_state=True)
    streams = MicroBatchStreams(seed=11)
    streams.hook_blocks([nn.ModuleList([wrapped if hook_outside else block])])
    x = torch.ones(256, requires_grad=True)
    streams.enter(1, 0)
    y = wrapped(x)
    streams.enter(1, 1)
    wrapped(torch.ones(256))
    y.sum().backward()
    assert x.grad is not None
    return x.grad, y.detach()


def test_activation_checkpointing_recomputes_the_forwards_masks() -> None:
    """The hook on the checkpoint's wrapper: the recomputation replays the stashed stream (gradient = the
    forward's mask); control: a hook inside the checkpointed region reseeds at recomputation for the micro-batch
    run last, and the gradient takes another mask."""
    grad, forward = _recomputed_grad(hook_outside=True)
    assert _bits(grad) == _bits(forward)
    grad, forward = _recomputed_grad(hook_outside=False)
    assert _bits(grad) != _bits(forward)
