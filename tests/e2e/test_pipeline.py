"""Pipeline parallelism resumes exactly: pp 2 under 1F1B, GPipe and Interleaved1F1B, and pp 2 x dp 2, each
stopped and resumed, writes the loss log of its uninterrupted run bit for bit (dropout on in every stage).

One set of runs, side by side, checked several ways:
* 1F1B: uninterrupted to step 4 (checkpoints at 2 and 4); the same run stopped by SIGTERM to rank 1 (the last
  stage) and resubmitted; and the control: step 2 resumed with the last stage's streams replaced by the
  first stage's, which must differ;
* GPipe (async checkpoints) and Interleaved1F1B (four stages on two ranks): uninterrupted, and resumed from its
  step-2 checkpoint into a fresh folder;
* pp 2 x dp 2 on four processes: ``verify_resume`` (stop at 2 by the end of steps, resume to 4, fingerprints of
  every stream of every rank compared).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.checks import assert_every_line_matches, rewrite_checkpoint
from tests.support.launch import EVERY_STEP, REPO, compare, together, train, verify
from torchtitan_rng.checkpoint.layout import TRAIN_STATE, complete_steps, rank_key
from torchtitan_rng.fault_injection import ENV_VAR as FAULT_ENV
from torchtitan_rng.loss_log import read_loss_log

STEPS = ("--training.steps", "4", "--lr_scheduler.total_steps", "4")
CKPT = ("--checkpoint.enable", "--checkpoint.interval", "2")
# Two stages, two micro-batches of 4 per schedule run (local batch 8), dropout 0.1 (the debug flavor's).
PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "4")
LAYOUTS = {
    "1F1B": (*PP2, "--parallelism.pipeline_parallel_schedule", "1F1B"),
    "GPipe": (*PP2, "--parallelism.pipeline_parallel_schedule", "GPipe", "--checkpoint.async_mode", "async",
              "--checkpoint.keep_latest_k", "0"),
    "Interleaved1F1B": (*PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", "--model.flavor",
                        "debug4"),
}


def _resume_from_step_2(source: Path, dump: Path, layout: tuple[str, ...]) -> None:
    train(dump, *STEPS, *layout, "--checkpoint.enable", "--checkpoint.initial_load_path",
          str(source / "checkpoint"), "--checkpoint.load_step", "2", nproc=2)


def _last_stage_gets_first_stages_streams(state: dict) -> None:
    state[TRAIN_STATE][rank_key(1)] = state[TRAIN_STATE][rank_key(0)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("pipeline")
    names = ("1F1B", "GPipe", "Interleaved1F1B", "1F1B_sigterm", "GPipe_resumed", "Interleaved1F1B_resumed",
             "control", "ppdp")
    dumps = {name: folder / name for name in names}
    outputs: dict[str, object] = {}

    def uninterrupted_then(name: str, then) -> None:
        train(dumps[name], *STEPS, *CKPT, *LAYOUTS[name], nproc=2)
        then()

    def control() -> None:
        shutil.copytree(dumps["1F1B"] / "checkpoint" / "step-2", dumps["control"] / "checkpoint" / "step-2")
        rewrite_checkpoint(dumps["control"] / "checkpoint" / "step-2", folder, _last_stage_gets_first_stages_streams)
        train(dumps["control"], *STEPS, *LAYOUTS["1F1B"], "--checkpoint.enable", nproc=2)

    def sigterm_and_resume() -> None:
        # Rank 1 alone is signalled before step 2; the ranks' vote stops both stages after step 3.
        outputs["stopped"] = train(dumps["1F1B_sigterm"], *STEPS, *CKPT, *LAYOUTS["1F1B"], *EVERY_STEP, nproc=2,
                                   env={FAULT_ENV: "before_step:2:1:SIGTERM"})
        outputs["saved"] = complete_steps(dumps["1F1B_sigterm"] / "checkpoint")
        train(dumps["1F1B_sigterm"], *STEPS, *CKPT, *LAYOUTS["1F1B"], nproc=2)

    def pp_dp() -> None:
        outputs["verify"] = verify("--config", str(REPO / "train_configs" / "llama_debug.toml"), "--steps", "4",
                                   "--stop-at", "2", "--nproc", "4", "--keep", str(dumps["ppdp"]), *PP2)

    together(lambda: uninterrupted_then("1F1B", control),
             sigterm_and_resume,
             lambda: uninterrupted_then("GPipe", lambda: _resume_from_step_2(dumps["GPipe"], dumps["GPipe_resumed"],
                                                                              LAYOUTS["GPipe"])),
             lambda: uninterrupted_then("Interleaved1F1B", lambda: _resume_from_step_2(
                 dumps["Interleaved1F1B"], dumps["Interleaved1F1B_resumed"], LAYOUTS["Interleaved1F1B"])),
             pp_dp)
    return {**dumps, **outputs}


@pytest.mark.parametrize("schedule", ["GPipe", "Interleaved1F1B"])
def test_resumed_from_step_2_equals_uninterrupted(runs: dict, schedule: str) -> None:
    resumed = runs[f"{schedule}_resumed"]
    assert sorted(read_loss_log(resumed)) == [3, 4]
    result = compare(runs[schedule], resumed, "--only-common-steps")
    assert result.returncode == 0, result.stdout
    assert_every_line_matches(runs[schedule], resumed)


def test_sigterm_to_one_stage_stops_both_at_one_step_and_resumes_exactly(runs: dict) -> None:
    assert runs["saved"] == [2, 3], runs["saved"]  # the interval's step 2, then the stop after step 3
    assert "stopped by a signal to another rank at step 3" in runs["stopped"].stdout
    assert sorted(read_loss_log(runs["1F1B_sigterm"])) == [1, 2, 3, 4]
    result = compare(runs["1F1B"], runs["1F1B_sigterm"])
    assert result.returncode == 0, result.stdout
    assert_every_line_matches(runs["1F1B"], runs["1F1B_sigterm"])


def test_control_one_stage_with_another_stages_streams_differs(runs: dict) -> None:
    """The comparison can fail: the last stage resumed with the first stage's streams is caught at step 3."""
    result = compare(runs["1F1B"], runs["control"], "--only-common-steps")
    assert result.returncode == 1
    assert result.stdout.startswith("first differing step 3:"), result.stdout


def test_pp_by_dp_verify_resume_passes(runs: dict) -> None:
    proc: subprocess.CompletedProcess = runs["verify"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith("PASS"), proc.stdout

