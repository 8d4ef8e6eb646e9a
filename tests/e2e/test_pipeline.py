"""Pipeline parallelism resumes exactly: pp 2 under 1F1B, GPipe and Interleaved1F1B, and pp 2 x dp 2, each
stopped and resumed, writes the loss log of its uninterrupted run bit for bit (dropout on in every stage).

One set of runs, side by side, checked several ways:
* 1F1B: uninterrupted to step 4 (checkpoints at 2 and 4), then from its step 2, side by side: resumed, the
  control, resumed with the last stage's streams replaced by the first stage's (it must differ), and its step 4
  replayed on 2 processes (``python -m torchtitan_rng.replay``: the last stage's micro-batches listed);
* GPipe with async checkpoints: stopped by SIGTERM to rank 1 (the last stage) and resubmitted; on two stages
  GPipe runs each stage's forwards and backwards in the order 1F1B does, so its reference is 1F1B's run;
* Interleaved1F1B (four stages on two ranks): ``verify_resume`` (stop at 2, resume to 4, stream fingerprints);
* pp 2 x dp 2 on four processes (``data_parallel_shard_degree 2``: dp_shard x pp = the process count, as in
  torchtitan): uninterrupted, and resumed from its step 2, fingerprints compared;
* (slow tier) the zero-bubble schedules (four stages on two ranks, weight gradients apart): each uninterrupted,
  and resumed from its step 2;
* 1F1B killed (SIGKILL to the last stage) while it writes its last checkpoint, then run again: it resumes from
  the complete checkpoint before, and its log is 1F1B's run.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.checks import assert_every_line_matches, float_bits, rewrite_checkpoint
from tests.support.launch import EVERY_STEP, REPO, compare, launch, together, train, verify
from torchtitan_rng import samples
from torchtitan_rng.checkpoint.layout import TRAIN_STATE, complete_steps, rank_key
from torchtitan_rng.fault_injection import ENV_VAR as FAULT_ENV
from torchtitan_rng.loss_log import read_loss_log

STEPS = ("--training.steps", "4", "--lr_scheduler.total_steps", "4")
CKPT = ("--checkpoint.enable", "--checkpoint.interval", "2")
# Two stages, two micro-batches of 4 per schedule run (local batch 8), dropout 0.1 (the debug flavor's), 2 loader
# workers per rank (the first stage's feed the inputs, the last stage's the labels).
PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "4",
       "--data.num_workers", "2")
LAYOUTS = {
    "1F1B": (*PP2, "--parallelism.pipeline_parallel_schedule", "1F1B"),
    "GPipe": (*PP2, "--parallelism.pipeline_parallel_schedule", "GPipe", "--checkpoint.async_mode", "async",
              "--checkpoint.keep_latest_k", "0"),
    "Interleaved1F1B": (*PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", "--model.flavor",
                        "debug4"),
    "ppdp": (*PP2, "--parallelism.data_parallel_shard_degree", "2", "--debug.rng_fingerprint"),
    "ZBVZeroBubble": (*PP2, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", "--model.flavor", "debug4"),
    "InterleavedZeroBubble": (*PP2, "--parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble",
                              "--model.flavor", "debug4"),
}
NPROC = {"1F1B": 2, "GPipe": 2, "Interleaved1F1B": 2, "ppdp": 4, "ZBVZeroBubble": 2, "InterleavedZeroBubble": 2}
ZERO_BUBBLE = ("ZBVZeroBubble", "InterleavedZeroBubble")


def _resume_from_step_2(source: Path, dump: Path, layout: str) -> None:
    train(dump, *STEPS, *LAYOUTS[layout], "--checkpoint.enable", "--checkpoint.initial_load_path",
          str(source / "checkpoint"), "--checkpoint.load_step", "2", nproc=NPROC[layout])


def _last_stage_gets_first_stages_streams(state: dict) -> None:
    state[TRAIN_STATE][rank_key(1)] = state[TRAIN_STATE][rank_key(0)]


def _run_and_resume_from_step_2(dumps: dict[str, Path], layout: str) -> None:
    """``layout`` uninterrupted (checkpoints at 2 and 4), then its step 2 resumed in a folder of its own."""
    train(dumps[layout], *STEPS, *CKPT, *LAYOUTS[layout], nproc=NPROC[layout])
    _resume_from_step_2(dumps[layout], dumps[f"{layout}_resumed"], layout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("pipeline")
    names = ("1F1B", "1F1B_resumed", "control", "GPipe_sigterm", "Interleaved1F1B", "ppdp", "ppdp_resumed",
             "1F1B_killed_saving")
    dumps = {name: folder / name for name in names}
    outputs: dict[str, object] = {}

    def control() -> None:
        shutil.copytree(dumps["1F1B"] / "checkpoint" / "step-2", dumps["control"] / "checkpoint" / "step-2")
        rewrite_checkpoint(dumps["control"] / "checkpoint" / "step-2", folder, _last_stage_gets_first_stages_streams)
        train(dumps["control"], *STEPS, *LAYOUTS["1F1B"], "--checkpoint.enable", nproc=2)

    def one_f_one_b() -> None:
        train(dumps["1F1B"], *STEPS, *CKPT, *LAYOUTS["1F1B"], "--metrics.log_samples", nproc=2)
        together(control, lambda: _resume_from_step_2(dumps["1F1B"], dumps["1F1B_resumed"], "1F1B"),
                 lambda: outputs.setdefault("replay", launch(
                     [sys.executable, "-m", "torchtitan_rng.replay", str(dumps["1F1B"]), "--step", "4",
                      "--processes", "2"], processes=2)))

    def sigterm_and_resume() -> None:
        # Rank 1 alone is signalled before step 2; the ranks' vote stops both stages after step 3.
        outputs["stopped"] = train(dumps["GPipe_sigterm"], *STEPS, *CKPT, *LAYOUTS["GPipe"], *EVERY_STEP, nproc=2,
                                   env={FAULT_ENV: "before_step:2:1:SIGTERM"})
        outputs["saved"] = complete_steps(dumps["GPipe_sigterm"] / "checkpoint")
        train(dumps["GPipe_sigterm"], *STEPS, *CKPT, *LAYOUTS["GPipe"], nproc=2)

    def interleaved() -> None:
        outputs["verify"] = verify("--config", str(REPO / "train_configs" / "llama_debug.toml"), "--steps", "4",
                                   "--stop-at", "2", "--nproc", "2", "--keep", str(dumps["Interleaved1F1B"]),
                                   *LAYOUTS["Interleaved1F1B"])

    def killed_while_saving() -> None:
        # Rank 1 (the last stage) kills itself halfway through writing step 4; the run again resumes from step 2.
        outputs["killed"] = train(dumps["1F1B_killed_saving"], *STEPS, *CKPT, *LAYOUTS["1F1B"], nproc=2,
                                  env={FAULT_ENV: "save_writing:4:1"}, check=False)
        outputs["complete_after_kill"] = complete_steps(dumps["1F1B_killed_saving"] / "checkpoint")
        train(dumps["1F1B_killed_saving"], *STEPS, *CKPT, *LAYOUTS["1F1B"], nproc=2)

    together(one_f_one_b, sigterm_and_resume, interleaved, killed_while_saving,
             lambda: _run_and_resume_from_step_2(dumps, "ppdp"))
    return {**dumps, **outputs}


@pytest.fixture(scope="module")
def zero_bubble_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The zero-bubble schedules' runs: the slow tier's (CI's), the everyday suite has the other schedules'."""
    folder = tmp_path_factory.mktemp("zero_bubble")
    dumps = {name: folder / name for layout in ZERO_BUBBLE for name in (layout, f"{layout}_resumed")}
    together(*(lambda layout=layout: _run_and_resume_from_step_2(dumps, layout) for layout in ZERO_BUBBLE))
    return dumps


@pytest.mark.parametrize("layout", ["1F1B", "ppdp",
                                    *(pytest.param(name, marks=pytest.mark.slow) for name in ZERO_BUBBLE)])
def test_resumed_from_step_2_equals_uninterrupted(runs: dict, layout: str, request: pytest.FixtureRequest) -> None:
    if layout in ZERO_BUBBLE:
        runs = request.getfixturevalue("zero_bubble_runs")
    resumed = runs[f"{layout}_resumed"]
    assert sorted(read_loss_log(resumed)) == [3, 4]
    result = compare(runs[layout], resumed, "--only-common-steps")
    assert result.returncode == 0, result.stdout
    assert_every_line_matches(runs[layout], resumed)


def test_pp_by_dp_streams_of_every_rank_equal_after_the_resume(runs: dict) -> None:
    """Every stream of all four ranks (both stages, both dp ranks) fingerprinted entering steps 3 and 4: the
    resumed run's equal the uninterrupted run's."""
    uninterrupted, resumed = read_loss_log(runs["ppdp"]), read_loss_log(runs["ppdp_resumed"])
    for step in (3, 4):
        prints = resumed[step]["rng_fingerprint"]
        assert len(prints) == 4 and prints == uninterrupted[step]["rng_fingerprint"], step


def test_sigterm_to_one_stage_stops_both_at_one_step_and_resumes_exactly(runs: dict) -> None:
    assert runs["saved"] == [2, 3], runs["saved"]  # the interval's step 2, then the stop after step 3
    assert "stopped by a signal to another rank at step 3" in runs["stopped"].stdout
    assert sorted(read_loss_log(runs["GPipe_sigterm"])) == [1, 2, 3, 4]
    result = compare(runs["1F1B"], runs["GPipe_sigterm"])
    assert result.returncode == 0, result.stdout
    assert_every_line_matches(runs["1F1B"], runs["GPipe_sigterm"])


def test_sigkill_while_saving_with_stages_resumes_from_the_checkpoint_before(runs: dict) -> None:
    killed: subprocess.CompletedProcess = runs["killed"]
    assert killed.returncode != 0, killed.stdout[-3000:]
    assert runs["complete_after_kill"] == [2], runs["complete_after_kill"]  # step 4's folder never counted
    result = compare(runs["1F1B"], runs["1F1B_killed_saving"])
    assert result.returncode == 0, result.stdout
    assert_every_line_matches(runs["1F1B"], runs["1F1B_killed_saving"])


def test_control_one_stage_with_another_stages_streams_differs(runs: dict) -> None:
    """The comparison can fail: the last stage resumed with the first stage's streams is caught at step 3."""
    result = compare(runs["1F1B"], runs["control"], "--only-common-steps")
    assert result.returncode == 1
    assert result.stdout.startswith("first differing step 3:"), result.stdout


def test_interleaved_verify_resume_passes(runs: dict) -> None:
    proc: subprocess.CompletedProcess = runs["verify"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "\nPASS: identical" in proc.stdout, proc.stdout


def test_replay_of_a_pipelined_step_lists_its_micro_batches(runs: dict) -> None:
    """Step 4 of the 1F1B run replayed on 2 processes from its step 2: the last stage's two micro-batches of 4
    samples (the halves of the step's batch), whose mean loss is the logged loss bit for bit, and the verdict.
    The step's batch is listed once (both stages load it) by the run's log, ``samples`` and the replay alike."""
    proc: subprocess.CompletedProcess = runs["replay"]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    logged = read_loss_log(runs["1F1B"])[4]
    assert proc.stdout.splitlines()[-1] == (f"step 4: loss {logged['loss']!r}, grad_norm {logged['grad_norm']!r}, "
                                            "equal to the run's loss log bit for bit")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("micro-batch ")]
    assert [line.split(":")[0] for line in lines] == ["micro-batch 0", "micro-batch 1"], proc.stdout
    keys = [[int(key) for key in line.split("samples ")[1].split()] for line in lines]
    (batch,) = samples.step_samples(runs["1F1B"], 4)[0]
    assert logged["samples"] == [batch] and keys == [batch[:4], batch[4:]]
    losses = torch.tensor([float(line.split()[3]) for line in lines])
    assert float_bits(float(losses.mean())) == float_bits(logged["loss"])
