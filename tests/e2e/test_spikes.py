"""Chasing a loss spike: the samples of a step (logged, and rebuilt by ``python -m torchtitan_rng.samples``) and
skipped steps (``training.skip_steps``) given at launch or added at a resume, bit for bit, in both modes.

One set of runs, side by side, checked several ways: in the ordinary mode with 2 dataloader workers and 2
micro-batches per step, a run skipping steps 4-5 from its launch, the same run stopped at step 3 and resumed with
the skip added, and a control whose "skip" loads no data; in the world-size-invariant mode the same pair, the
launched one on 2 processes, the resumed one on 1 (the mode makes them equal), and a replay of its step 5 on 1.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.checks import assert_refused, float_bits
from tests.support.launch import REPO, compare, run_env, together, train
from torchtitan_rng.loss_log import read_loss_log
from torchtitan_rng.samples import step_samples

STEPS = 6
SKIP = "4-5"
# 16 samples a step over 64 per epoch: steps 5-6 are the second epoch.
COMMON = ("--training.steps", str(STEPS), "--lr_scheduler.total_steps", str(STEPS), "--training.global_batch_size", "16",
          "--metrics.log_samples", "--checkpoint.enable", "--checkpoint.interval", "3")
ORDINARY = (*COMMON, "--data.num_workers", "2")
INVARIANT = (*COMMON, "--parallelism.world_size_invariant")


def _skip_at_resume(dump: Path, *overrides: str) -> subprocess.CompletedProcess:
    train(dump, *overrides, "--training.steps", "3")
    return train(dump, *overrides, "--training.skip_steps", SKIP)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    names = ("launch", "resume", "control", "invariant_launch", "invariant_resume")
    dumps = {name: tmp_path_factory.mktemp(name) for name in names}
    resumed, _, _, invariant_resumed, _ = together(
        lambda: _skip_at_resume(dumps["resume"], *ORDINARY),
        lambda: train(dumps["launch"], *ORDINARY, "--training.skip_steps", SKIP),
        lambda: train(dumps["control"], *ORDINARY, "--training.skip_steps", SKIP,
                      "--job.custom_module", "tests.support.skip_without_data"),
        lambda: _skip_at_resume(dumps["invariant_resume"], *INVARIANT),
        lambda: train(dumps["invariant_launch"], *INVARIANT, "--training.skip_steps", SKIP, nproc=2),
    )
    for proc in (resumed, invariant_resumed):  # the change is named at the resume, not refused
        assert "note: training.skip_steps = '4-5' but checkpoint" in proc.stdout, proc.stdout
    return dumps


@pytest.mark.parametrize("mode", ["", "invariant_"])
def test_skip_added_at_resume_equals_skip_at_launch(runs: dict[str, Path], mode: str) -> None:
    launch, resume = runs[f"{mode}launch"], runs[f"{mode}resume"]
    proc = compare(launch, resume)
    assert proc.returncode == 0, proc.stdout
    log = read_loss_log(launch)
    assert sorted(step for step, record in log.items() if record.get("skipped")) == [4, 5]


def test_a_skip_that_loads_no_data_differs(runs: dict[str, Path]) -> None:
    """Control: the "skip" of tests/support/skip_without_data.py leaves step 4's samples to step 6."""
    skipped, wrong = read_loss_log(runs["launch"]), read_loss_log(runs["control"])
    assert all(float_bits(skipped[s]["loss"]) == float_bits(wrong[s]["loss"]) for s in (1, 2, 3))
    assert all(float_bits(skipped[s]["loss"]) != float_bits(wrong[s]["loss"]) for s in (6,))
    assert wrong[6]["samples"] == skipped[4]["samples"] != skipped[6]["samples"]


@pytest.mark.parametrize("mode", ["", "invariant_"])
def test_samples_of_a_step_are_what_the_run_loaded(runs: dict[str, Path], mode: str) -> None:
    """(a): the keys the run logged (carried through its workers with the batches) are those the record rebuilds."""
    dump = runs[f"{mode}launch"]
    log = read_loss_log(dump)
    assert sorted(log) == list(range(1, STEPS + 1))
    for step, record in log.items():
        assert len(record["samples"]) == 2 and all(len(keys) == 8 for keys in record["samples"])
        assert step_samples(dump, step)[0] == record["samples"], step
    # The printed form, and the JSON one, from the command itself.
    proc = subprocess.run([sys.executable, "-m", "torchtitan_rng.samples", str(dump), "--step", "6", "--json"],
                          cwd=REPO, capture_output=True, text=True, env=run_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"step": 6, "samples": log[6]["samples"]}


def test_samples_refuses_a_streaming_run(runs: dict[str, Path], tmp_path: Path) -> None:
    dump = tmp_path / "run"
    shutil.copytree(runs["launch"], dump)
    for record_file in dump.glob("checkpoint/step-*/run.json"):
        record = json.loads(record_file.read_text())
        record["config"]["data.streaming"] = True
        record_file.write_text(json.dumps(record))
    proc = subprocess.run([sys.executable, "-m", "torchtitan_rng.samples", str(dump), "--step", "2"], cwd=REPO,
                          capture_output=True, text=True, env=run_env(), timeout=120)
    assert_refused(proc, "streaming source", "no index")
    control = subprocess.run([sys.executable, "-m", "torchtitan_rng.samples", str(runs["launch"]), "--step", "2"],
                             cwd=REPO, capture_output=True, text=True, env=run_env(), timeout=120)
    assert control.returncode == 0 and "micro-batch 1: " in control.stdout, control.stderr


def _replay(dump: Path, step: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchtitan_rng.replay", str(dump), "--step", str(step)], cwd=REPO,
                          capture_output=True, text=True, env=run_env(), timeout=600)


def test_replay_of_a_two_process_step_on_one_process(runs: dict[str, Path], tmp_path: Path) -> None:
    """(b): step 5 of the 2-process invariant run, replayed on 1 process from its checkpoint of step 3, reports
    the logged loss bit for bit, and micro-batch losses whose mean (the step's tree: (a + b) / 2 in float32) is it."""
    dump = runs["invariant_launch"]
    logged = read_loss_log(dump)[5]
    # Control first, on a copy whose log says another loss for step 5: the replay must say so and exit 1.
    altered = tmp_path / "altered"
    shutil.copytree(dump, altered)
    log = altered / "loss_log.jsonl"
    log.write_text(log.read_text().replace(json.dumps(logged["loss"]), json.dumps(logged["loss"] + 1e-6)))
    proc, control = together(lambda: _replay(dump, 5), lambda: _replay(altered, 5))
    assert control.returncode == 1 and "but the run's loss log has" in control.stdout, control.stdout + control.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"from checkpoint {dump / 'checkpoint' / 'step-3'}" in proc.stdout
    assert "equal to the run's loss log bit for bit" in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("micro-batch ")]
    losses = [float(line.split()[3]) for line in lines]
    assert [[int(key) for key in line.split("samples ")[1].split()] for line in lines] == logged["samples"]
    mean = (torch.tensor(losses[0]) + torch.tensor(losses[1])) / 2
    assert float_bits(float(mean)) == float_bits(logged["loss"])
