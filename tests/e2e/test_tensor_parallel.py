"""Tensor parallelism in the ordinary mode resumes exactly: tp 2, dp 2 x tp 2 (two loader workers per rank) and
pp 2 x tp 2, each stopped at step 2 and resumed, writes the loss log of its uninterrupted run bit for bit (dropout
on). One reference run per layout; everything else resumes from its checkpoint, side by side:

* tp 2: resumed; the control, resumed with one extra draw from rank 1's CPU stream entering step 3 (the group's
  replicated dropout then draws two masks: the losses differ and the save after it names the two streams); the
  same config on one process (tp 1), which the ordinary mode does not promise to equal (it differs); the
  checkpoint resumed at tp 1 on the same two processes: refused by the launcher in one line, or with
  ``on_world_size_change reseed`` continued with the WARNING that names the rule the streams follow;
* dp 2 x tp 2: resumed, every rank's stream fingerprints compared too (the two ranks of a tensor-parallel
  group equal, the two groups not);
* pp 2 x tp 2 (the slow tier): resumed.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.checks import assert_every_line_matches, assert_refused
from tests.support.launch import compare, together, train
from torchtitan_rng.loss_log import read_loss_log

STEPS = ("--training.steps", "3", "--lr_scheduler.total_steps", "3")
CKPT = ("--checkpoint.enable", "--checkpoint.interval", "2")
TP2 = ("--parallelism.tensor_parallel_degree", "2")
LAYOUTS = {
    "tp": TP2,
    "dptp": (*TP2, "--data.num_workers", "2", "--debug.rng_fingerprint"),
    "pptp": (*TP2, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size",
             "4"),
}
NPROC = {"tp": 2, "dptp": 4, "pptp": 4}


def _from_step_2(source: Path, dump: Path, *overrides: str, nproc: int,
                 check: bool = True) -> subprocess.CompletedProcess:
    return train(dump, *STEPS, "--checkpoint.enable", "--checkpoint.initial_load_path", str(source / "checkpoint"),
                 "--checkpoint.load_step", "2", *overrides, nproc=nproc, check=check)


def _resumed(dumps: dict[str, Path], layout: str) -> None:
    train(dumps[layout], *STEPS, *CKPT, *LAYOUTS[layout], nproc=NPROC[layout])
    _from_step_2(dumps[layout], dumps[f"{layout}_resumed"], *LAYOUTS[layout], nproc=NPROC[layout])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """tp 2 and dp 2 x tp 2 (the normal tier)."""
    folder = tmp_path_factory.mktemp("tensor_parallel")
    names = ("tp", "tp_resumed", "dptp", "dptp_resumed", "control", "tp1", "tp1_resume", "reseeded")
    dumps = {name: folder / name for name in names}
    outputs: dict[str, object] = {}

    def tp() -> None:
        train(dumps["tp"], *STEPS, *CKPT, *LAYOUTS["tp"], nproc=2)
        together(
            lambda: outputs.setdefault("resumed_out", _from_step_2(dumps["tp"], dumps["tp_resumed"], *LAYOUTS["tp"],
                                                               nproc=2)),
            lambda: outputs.setdefault("control_out", _from_step_2(dumps["tp"], dumps["control"], *LAYOUTS["tp"],
                                                               "--debug.perturb_rng", "torch_cpu:1:3", nproc=2)),
            lambda: outputs.setdefault("refused_out", _from_step_2(dumps["tp"], dumps["tp1_resume"], nproc=2,
                                                               check=False)),
            lambda: outputs.setdefault("reseeded_out", _from_step_2(dumps["tp"], dumps["reseeded"],
                                                                "--checkpoint.on_world_size_change", "reseed",
                                                                nproc=2)),
        )

    together(tp, lambda: train(dumps["tp1"], *STEPS), lambda: _resumed(dumps, "dptp"))
    return {**dumps, **outputs}


@pytest.fixture(scope="module")
def staged_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """pp 2 x tp 2 (the slow tier)."""
    folder = tmp_path_factory.mktemp("tensor_parallel_staged")
    dumps = {name: folder / name for name in ("pptp", "pptp_resumed")}
    _resumed(dumps, "pptp")
    return dumps


def _assert_resumed_equals_uninterrupted(runs: dict, layout: str) -> None:
    resumed = runs[f"{layout}_resumed"]
    assert sorted(read_loss_log(resumed)) == [3]
    result = compare(runs[layout], resumed, "--only-common-steps")
    assert result.returncode == 0, result.stdout
    assert_every_line_matches(runs[layout], resumed)


@pytest.mark.parametrize("layout", ["tp", "dptp"])
def test_resumed_from_step_2_equals_uninterrupted(runs: dict, layout: str) -> None:
    _assert_resumed_equals_uninterrupted(runs, layout)


@pytest.mark.slow
def test_pp_by_tp_resumed_from_step_2_equals_uninterrupted(staged_runs: dict) -> None:
    _assert_resumed_equals_uninterrupted(staged_runs, "pptp")


def test_dp_by_tp_streams_of_every_rank_equal_after_the_resume_and_alike_within_a_group(runs: dict) -> None:
    """Entering step 3, every stream of all four ranks: the resumed run's are the uninterrupted run's; ranks 0
    and 1 (one tensor-parallel group, one data shard) hold the same streams and loader state, and so do 2 and 3;
    the two groups hold other ones (their own data shard's)."""
    prints = read_loss_log(runs["dptp_resumed"])[3]["rng_fingerprint"]
    assert len(prints) == 4 and prints == read_loss_log(runs["dptp"])[3]["rng_fingerprint"]
    assert prints[0] == prints[1] and prints[2] == prints[3]
    assert all(prints[0][name] != prints[2][name] for name in ("torch_cpu", "python", "numpy", "dataloader"))


def test_control_one_rank_of_the_group_with_another_stream_differs_and_is_named(runs: dict) -> None:
    """The comparison can fail: rank 1's CPU stream one draw ahead of rank 0's entering step 3 changes step 3,
    and the save at step 3 names the group's two streams (no save before it had a word to say)."""
    result = compare(runs["tp"], runs["control"], "--only-common-steps")
    assert result.returncode == 1 and result.stdout.startswith("first differing step 3:"), result.stdout
    out = runs["control_out"].stdout
    warnings = [line for line in out.splitlines() if "tensor-parallel group hold different" in line]
    assert len(warnings) == 1 and "WARNING: at step 3 the ranks of a tensor-parallel group hold different " \
        "torch_cpu random streams (rank 0: " in warnings[0], out[-3000:]
    assert "tensor-parallel group hold different" not in runs["resumed_out"].stdout


def test_the_ordinary_mode_at_tp_2_differs_from_one_process(runs: dict) -> None:
    """The ordinary mode promises a layout's own bits, not another's: tp 2 and tp 1 differ (the attention's
    dropout draws per rank's heads, the row-split sums add two partials)."""
    result = compare(runs["tp"], runs["tp1"])
    assert result.returncode == 1, result.stdout


def test_another_degree_at_a_resume_is_refused_before_training_or_reseeded_with_its_rule(runs: dict) -> None:
    refused: subprocess.CompletedProcess = runs["refused_out"]
    assert_refused(refused, "was saved by parallelism.tensor_parallel_degree = 2 and this run has 1: it cannot "
                            "resume exactly", "run with --parallelism.tensor_parallel_degree 2")
    assert not (runs["tp1_resume"] / "loss_log.jsonl").exists()
    reseeded: subprocess.CompletedProcess = runs["reseeded_out"]
    warnings = [line for line in reseeded.stdout.splitlines() if "WARNING: resuming" in line]
    assert len(warnings) == 1 and warnings[0].endswith(
        "with 2 processes at parallelism.tensor_parallel_degree = 1 instead of the 2 at 2 that saved it: model and "
        "optimizer are resharded; every rank's random streams are reseeded from (seed, \"reseed\", step) and its "
        "data shard and stage (the ranks of a tensor-parallel group alike), the data keeps its global position; "
        "this run is no longer exact"), reseeded.stdout[-3000:]
    assert sorted(read_loss_log(runs["reseeded"])) == [3]
