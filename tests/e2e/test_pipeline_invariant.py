"""The world-size-invariant mode under pipeline parallelism: one process, pp 2 under GPipe, 1F1B (with activation
checkpointing) and Interleaved1F1B, and pp 2 x dp 2 write the same loss log bit for bit, dropout on in every
block; the pp 2 x dp 2 checkpoint resumed on one process without stages goes on with the same bits, and
``python -m torchtitan_rng.replay`` replays a step of that run on one process.

Control: the ordinary mode, one process against pp 2 on the same batches, differs from the first step (a stage's
dropout draws from its own rank's stream there).

Every run is launched once (module fixtures; 1F1B with activation checkpointing and Interleaved1F1B in the
slow tier), side by side, and checked several ways. (The pieces without
training: tests/unit/test_pipeline_invariant.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checks import assert_every_line_matches
from tests.support.launch import compare, launch, together, train
from torchtitan_rng import samples
from torchtitan_rng.loss_log import read_loss_log

STEPS, STOP = 4, 2
# Four micro-batches of 2 per step (debug4: the debug width with four blocks, dropout 0.1, enough blocks for
# four stages on two ranks); training.max_norm 1.0 from llama_debug clips, so the gradient norm counts too.
COMMON = ("--model.flavor", "debug4", "--training.steps", str(STEPS), "--lr_scheduler.total_steps", str(STEPS))
INVARIANT = (*COMMON, "--parallelism.world_size_invariant", "--training.local_batch_size", "2",
             "--training.global_batch_size", "8")


def _pp2(schedule: str, microbatch_size: str = "2") -> tuple[str, ...]:
    size = ("--parallelism.pipeline_parallel_microbatch_size", microbatch_size) if microbatch_size else ()
    return ("--parallelism.pipeline_parallel_degree", "2", *size, "--parallelism.pipeline_parallel_schedule", schedule)


# name: (overrides, processes); all invariant, compared with "pp1". GPipe leaves the micro-batch size unset: the
# mode runs its own (training.local_batch_size).
LAYOUTS = {
    "pp1": ((), 1),
    "GPipe": (_pp2("GPipe", microbatch_size=""), 2),
    "1F1B_recomputed": ((*_pp2("1F1B"), "--activation_checkpoint.mode", "full"), 2),
    "Interleaved1F1B": (_pp2("Interleaved1F1B"), 2),
    "pp2_dp2": ((*_pp2("1F1B"), "--checkpoint.enable", "--checkpoint.interval", str(STOP), "--metrics.log_samples"),
                4),
}
# 1F1B with activation checkpointing and Interleaved1F1B: the slow tier, which CI runs (every day: GPipe, 1F1B at
# pp 2 x dp 2).
CI_TIER = ("1F1B_recomputed", "Interleaved1F1B")
COMPARED = [pytest.param(name, marks=pytest.mark.slow) if name in CI_TIER else name
            for name in LAYOUTS if name != "pp1"]
# The control: the ordinary mode on the same 8 samples per step (one batch, no accumulation), two steps.
ORDINARY = (*COMMON[:2], "--training.steps", "2", "--lr_scheduler.total_steps", "2")


def _layout(dumps: dict[str, Path], name: str) -> None:
    overrides, nproc = LAYOUTS[name]
    train(dumps[name], *INVARIANT, *overrides, nproc=nproc)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pipeline_invariant")
    dumps = {name: folder / name for name in LAYOUTS if name not in CI_TIER}
    dumps.update({name: folder / name for name in ("replay", "ordinary_pp1", "ordinary_pp2")})
    replayed: dict[str, subprocess.CompletedProcess] = {}

    def pp_dp_then_replay() -> None:
        _layout(dumps, "pp2_dp2")
        together(lambda: train(dumps["replay"], *INVARIANT, "--checkpoint.enable", "--checkpoint.initial_load_path",
                               str(dumps["pp2_dp2"] / "checkpoint"), "--checkpoint.load_step", str(STOP)),
                 lambda: replayed.setdefault("tool", launch(
                     [sys.executable, "-m", "torchtitan_rng.replay", str(dumps["pp2_dp2"]), "--step", str(STOP + 1),
                      "--processes", "1"])))

    together(pp_dp_then_replay, *(lambda name=name: _layout(dumps, name) for name in LAYOUTS
                                   if name not in ("pp2_dp2", *CI_TIER)),
             lambda: train(dumps["ordinary_pp1"], *ORDINARY),
             lambda: train(dumps["ordinary_pp2"], *ORDINARY, *_pp2("1F1B"), nproc=2))
    tool = replayed["tool"]
    (folder / "replay_tool.json").write_text(json.dumps([tool.returncode, tool.stdout, tool.stderr[-3000:]]))
    return dumps


@pytest.fixture(scope="module")
def ci_tier_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pipeline_invariant_ci")
    dumps = {name: folder / name for name in CI_TIER}
    together(*(lambda name=name: _layout(dumps, name) for name in CI_TIER))
    return dumps


def _layout_run(runs: dict[str, Path], name: str, request: pytest.FixtureRequest) -> Path:
    return (request.getfixturevalue("ci_tier_runs") if name in CI_TIER else runs)[name]


@pytest.mark.parametrize("name", COMPARED)
def test_every_layout_writes_the_one_process_bits(runs: dict[str, Path], name: str,
                                                  request: pytest.FixtureRequest) -> None:
    run = _layout_run(runs, name, request)
    assert sorted(read_loss_log(run)) == list(range(1, STEPS + 1))
    result = compare(runs["pp1"], run)
    assert result.returncode == 0, result.stdout
    assert_every_line_matches(runs["pp1"], run)


@pytest.mark.parametrize("name", COMPARED)
def test_every_layout_has_the_one_process_gradient_norm(runs: dict[str, Path], name: str,
                                                        request: pytest.FixtureRequest) -> None:
    """The norm the step clipped by: every stage's row squares, put in the whole model's order before one sum."""
    reference, log = read_loss_log(runs["pp1"]), read_loss_log(_layout_run(runs, name, request))
    assert [log[step]["grad_norm"].hex() for step in log] == [reference[step]["grad_norm"].hex() for step in log]


def test_pp2_dp2_checkpoint_replayed_on_one_process_without_stages(runs: dict[str, Path]) -> None:
    assert sorted(read_loss_log(runs["replay"])) == list(range(STOP + 1, STEPS + 1))
    result = compare(runs["pp1"], runs["replay"], "--only-common-steps")
    assert result.returncode == 0, result.stdout
    assert_every_line_matches(runs["pp1"], runs["replay"])


def test_replay_tool_replays_a_pipelined_step_on_one_process(runs: dict[str, Path]) -> None:
    """The step's four micro-batches are numbered alike by the pp 2 x dp 2 run's log, ``samples`` and the replay
    on one process: in slot order (the dp columns run slots 0, 2 and 1, 3), each once (both stages load them)."""
    returncode, out, err = json.loads((runs["replay"].parent / "replay_tool.json").read_text())
    assert returncode == 0, out + err
    assert f"step {STOP + 1}: loss" in out and "equal to the run's loss log bit for bit" in out, out
    printed = [[int(key) for key in line.split("samples ")[1].split()] for line in out.splitlines()
               if line.startswith("micro-batch ")]
    logged = read_loss_log(runs["pp2_dp2"])[STOP + 1]["samples"]
    assert len(printed) == 4 and printed == logged == samples.step_samples(runs["pp2_dp2"], STOP + 1)[0], out


def test_control_ordinary_mode_differs_across_layouts_from_the_first_step(runs: dict[str, Path]) -> None:
    """The comparison can fail: in the ordinary mode the last stage's dropout comes from rank 1's stream."""
    result = compare(runs["ordinary_pp1"], runs["ordinary_pp2"])
    assert result.returncode == 1
    assert result.stdout.startswith("first differing step 1:"), result.stdout
