"""Chasing a loss spike: the samples of a step (logged, and rebuilt by ``python -m torchtitan_rng.samples``), a
step replayed on one process (``python -m torchtitan_rng.replay``), and steps skipped (``training.skip_steps``
given at launch or added at a resume, or decided by ``training.spike_guard``), bit for bit.

One set of runs, side by side, checked several ways. Every run has the same injected spike: the losses of steps
4 and 5 times 1000 (``loss_spike`` of ``fault_injection.py``), as batches of broken samples would make them. In
the ordinary mode, with 2 dataloader workers and 2 micro-batches per step: a run told to skip steps 4-5 at its
launch; the same stopped at step 3 and resumed with the skip added; a guarded run that decides the skips itself;
and a control whose "skip" loads no data (all Llama). In the world-size-invariant mode, with the Flux trainer: the
skip at launch on 2 processes, and the guard on 1 (the mode makes them equal), stopped at step 3 and resumed (its
window comes back from the checkpoint); step 6 of the 2-process run is replayed on 1 process as soon as that run
ends.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.checks import float_bits, rewrite_checkpoint
from tests.support.launch import REPO, compare, run_env, together, train
from torchtitan_rng import replay, samples
from torchtitan_rng.loss_log import read_loss_log

STEPS = 6
SKIP = "4-5"
SPIKES = {"TORCHTITAN_RNG_FAULT": "loss_spike:4;loss_spike:5"}
GUARD = ("--training.spike_guard", "loss,factor=3,warmup=2")
REPLAYED = 6
# 16 samples a step over 64 per epoch: steps 5-6 are the second epoch.
# The horizon is one step past the last, so that step 6 still updates (its learning rate is not 0).
COMMON = ("--training.steps", str(STEPS), "--lr_scheduler.total_steps", str(STEPS + 1),
          "--training.global_batch_size", "16", "--metrics.log_samples", "--checkpoint.enable", "--checkpoint.interval", "3")
ORDINARY = (*COMMON, "--data.num_workers", "2")
INVARIANT = (*COMMON, "--parallelism.world_size_invariant", "--validation.enable", "false")
FLUX = "flux_debug"  # the invariant runs train the other trainer: 48 samples an epoch, diffusion noise drawn


def _stopped_and_resumed(dump: Path, first: tuple[str, ...], then: tuple[str, ...],
                         config: str = "llama_debug") -> subprocess.CompletedProcess:
    train(dump, *first, "--training.steps", "3", env=SPIKES, config=config)
    return train(dump, *then, env=SPIKES, config=config)


def _replay(dump: Path, step: int) -> subprocess.CompletedProcess:
    """The command as a user runs it; the spike is injected as in the run (it stands for the data)."""
    return subprocess.run([sys.executable, "-m", "torchtitan_rng.replay", str(dump), "--step", str(step)], cwd=REPO,
                          capture_output=True, text=True, env=run_env(SPIKES), timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    names = ("launch", "resume", "guard", "control", "invariant_launch", "invariant_guard")
    dumps: dict[str, Path] = {name: tmp_path_factory.mktemp(name) for name in names}
    skip = ("--training.skip_steps", SKIP)
    resumed, guarded, _, _, replayed, guarded_again = together(
        lambda: _stopped_and_resumed(dumps["resume"], ORDINARY, (*ORDINARY, *skip)),
        lambda: train(dumps["guard"], *ORDINARY, *GUARD, env=SPIKES),
        lambda: train(dumps["launch"], *ORDINARY, *skip, env=SPIKES),
        lambda: train(dumps["control"], *COMMON, *skip, "--job.custom_module", "tests.support.skip_without_data",
                      env=SPIKES),  # no workers: they change no bit, and the control is the cheaper
        lambda: (train(dumps["invariant_launch"], *INVARIANT, *skip, nproc=2, env=SPIKES, config=FLUX),
                 _replay(dumps["invariant_launch"], REPLAYED))[1],
        lambda: _stopped_and_resumed(dumps["invariant_guard"], (*INVARIANT, *GUARD), (*INVARIANT, *GUARD), FLUX),
    )
    # The skip added at the resume is named, not refused; the guard says what it skipped.
    assert "note: training.skip_steps = '4-5' but checkpoint" in resumed.stdout, resumed.stdout
    for proc in (guarded, guarded_again):
        assert "spike guard: step 4 skipped (loss " in proc.stdout and "spike guard: step 5" in proc.stdout
    (dumps["invariant_launch"] / "replay.out").write_text(json.dumps([replayed.returncode, replayed.stdout,
                                                                      replayed.stderr]))
    return dumps


@pytest.mark.parametrize(("a", "b"), [("launch", "resume"), ("launch", "guard"),
                                      ("invariant_launch", "invariant_guard")])
def test_a_skip_at_launch_at_a_resume_or_by_the_guard_is_the_same_run(runs: dict[str, Path], a: str, b: str) -> None:
    """(c): bitwise equal losses, and every line the same (gradient norms, learning rates, the skipped flags, the
    samples): the guard decided the steps the others were told, and left out exactly their updates."""
    proc = compare(runs[a], runs[b])
    assert proc.returncode == 0, proc.stdout
    log_a, log_b = read_loss_log(runs[a]), read_loss_log(runs[b])
    assert log_a == log_b
    assert [step for step, record in log_a.items() if record.get("skipped")] == [4, 5]
    assert all(float_bits(log_a[s]["grad_norm"]) == float_bits(log_b[s]["grad_norm"]) for s in log_a)


def test_a_skip_that_loads_no_data_differs(runs: dict[str, Path]) -> None:
    """Control: the "skip" of tests/support/skip_without_data.py leaves step 4's samples to step 6."""
    skipped, wrong = read_loss_log(runs["launch"]), read_loss_log(runs["control"])
    assert all(float_bits(skipped[s]["loss"]) == float_bits(wrong[s]["loss"]) for s in (1, 2, 3))
    assert float_bits(skipped[6]["loss"]) != float_bits(wrong[6]["loss"])
    assert wrong[6]["samples"] == skipped[4]["samples"] != skipped[6]["samples"]
    assert compare(runs["launch"], runs["control"]).returncode == 1


@pytest.mark.parametrize("mode", ["", "invariant_"])
def test_samples_of_a_step_are_what_the_run_loaded(runs: dict[str, Path], mode: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """(a): the keys the run logged (carried through its workers with the batches) are those the record rebuilds,
    for every step, and the command prints them."""
    dump = runs[f"{mode}launch"]
    log = read_loss_log(dump)
    assert sorted(log) == list(range(1, STEPS + 1))
    for step, record in log.items():
        assert len(record["samples"]) == 2 and all(len(keys) == 8 for keys in record["samples"])
        assert samples.step_samples(dump, step)[0] == record["samples"], step
    assert samples.main([str(dump), "--step", "6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"step": 6, "samples": log[6]["samples"]}


def test_samples_refuses_a_streaming_run(runs: dict[str, Path], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    dump = tmp_path / "run"
    shutil.copytree(runs["launch"], dump)
    for record_file in dump.glob("checkpoint/step-*/run.json"):
        record = json.loads(record_file.read_text())
        record["config"]["data.streaming"] = True
        record_file.write_text(json.dumps(record))
    assert samples.main([str(dump), "--step", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "streaming source" in err and "no index" in err
    assert samples.main([str(runs["launch"]), "--step", "2"]) == 0  # control: the run as it is
    assert "micro-batch 1: " in capsys.readouterr().out


def test_replay_of_a_two_process_step_on_one_process(runs: dict[str, Path]) -> None:
    """(b): step 6 of the 2-process invariant run (after its skipped steps 4-5), replayed on 1 process from its
    checkpoint of step 3, reports the logged loss and gradient norm bit for bit, micro-batch losses whose mean
    (the step's tree: (a + b) / 2 in float32) is the loss, and each micro-batch's samples, gradient norms (per
    block) and the step's update norm."""
    dump = runs["invariant_launch"]
    returncode, out, err = json.loads((dump / "replay.out").read_text())
    logged = read_loss_log(dump)[REPLAYED]
    assert returncode == 0, out + err
    assert f"replayed step {REPLAYED} of {dump} on 1 process from checkpoint {dump / 'checkpoint' / 'step-3'}" in out
    assert out.splitlines()[-1] == (f"step {REPLAYED}: loss {logged['loss']!r}, grad_norm {logged['grad_norm']!r}, "
                                    "equal to the run's loss log bit for bit")
    lines = [line for line in out.splitlines() if line.startswith("micro-batch ")]
    assert [[int(key) for key in line.split("samples ")[1].split()] for line in lines] == logged["samples"]
    losses = [float(line.split()[3]) for line in lines]
    mean = (torch.tensor(losses[0]) + torch.tensor(losses[1])) / 2
    assert float_bits(float(mean)) == float_bits(logged["loss"])
    blocks = [line for line in out.splitlines() if line.startswith("  grad_norm per block: ")]
    assert len(blocks) == 2 and all("transformer.double_blocks.0 " in line for line in blocks)
    update = next(line for line in out.splitlines() if line.startswith(f"step {REPLAYED}: update norm "))
    assert float(update.split()[4]) > 0 and "skipped" not in update
    # Control: the verdict tells a log whose loss differs by one part in a million, in one line.
    replayed = {"loss": logged["loss"], "grad_norm": logged["grad_norm"]}
    equal, line = replay.verdict(REPLAYED, replayed, {**logged, "loss": logged["loss"] * (1 + 1e-6)})
    assert not equal and "but the run's loss log has loss" in line and "\n" not in line


def test_replay_refuses_an_ordinary_run_of_two_processes(runs: dict[str, Path], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """An ordinary run is continued exactly only by the process count that saved it: one line, exit 2, nothing
    trained. The copy's checkpoints get a second rank's train state (as 2 processes save it)."""
    dump = tmp_path / "run"
    shutil.copytree(runs["launch"], dump)
    for step in (3, 6):
        checkpoint = dump / "checkpoint" / f"step-{step}"
        record = (checkpoint / "run.json").read_text()
        rewrite_checkpoint(checkpoint, tmp_path, lambda s: s["train_state"].update(rank_1=s["train_state"]["rank_0"]))
        (checkpoint / "run.json").write_text(record)
    assert replay.main([str(dump), "--step", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: replay runs on one process, and one cannot continue ")
    assert "saved by 2 processes" in err and "--checkpoint.initial_load_path" in err
