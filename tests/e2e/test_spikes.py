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
ends. An ordinary run of 2 processes (FSDP2) on a token file, guarded, is replayed at step 6 on 2 processes. The
guard against the skip at launch once more with ``compile.enable`` (1 process) and with 2 pipeline stages.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.checks import float_bits
from tests.support.launch import REPO, launch, compare, run_env, together, train
from tests.support.token_data import write_jsonl, write_token_file
from torchtitan_rng import replay, samples
from torchtitan_rng.checkpoint import integrity
from torchtitan_rng.config import parse_args
from torchtitan_rng.loss_log import read_loss_log
from torchtitan_rng.models import get_train_spec
from torchtitan_rng.models.llama.dataset import load_tokens

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
# Compile and pipeline stages: the loss log alone, each pair the guard and the skip at launch.
PLAIN = ("--training.steps", str(STEPS), "--lr_scheduler.total_steps", str(STEPS + 1),
         "--training.global_batch_size", "16", "--metrics.log_samples")
COMPILED = (*PLAIN, "--compile.enable")
PIPELINE = (*PLAIN, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size",
            "4")
WINDOW = 65  # llama_debug's seq_len + 1 tokens a sample


def _stopped_and_resumed(dump: Path, first: tuple[str, ...], then: tuple[str, ...],
                         config: str = "llama_debug") -> subprocess.CompletedProcess:
    train(dump, *first, "--training.steps", "3", env=SPIKES, config=config)
    return train(dump, *then, env=SPIKES, config=config)


def _replay(dump: Path, step: int, *args: str) -> subprocess.CompletedProcess:
    """The command as a user runs it; the spike is injected as in the run (it stands for the data). Its result is
    kept in the dump folder for the tests."""
    proc = launch([sys.executable, "-m", "torchtitan_rng.replay", str(dump), "--step", str(step), *args],
                  env=run_env(SPIKES))
    (dump / "replay.out").write_text(json.dumps([proc.returncode, proc.stdout, proc.stderr]))
    return proc


def _replayed(dump: Path) -> tuple[int, str, str]:
    returncode, out, err = json.loads((dump / "replay.out").read_text())
    return returncode, out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    names = ("launch", "resume", "guard", "control", "invariant_launch", "invariant_guard", "ordinary_2",
             "compiled_guard", "compiled_launch", "pipeline_guard", "pipeline_launch")
    dumps: dict[str, Path] = {name: tmp_path_factory.mktemp(name) for name in names}
    tokens = write_token_file(tmp_path_factory.mktemp("data") / "train.bin")
    skip = ("--training.skip_steps", SKIP)
    resumed, guarded, _, _, _, guarded_again, guarded_2, compiled, staged, _ = together(
        lambda: _stopped_and_resumed(dumps["resume"], ORDINARY, (*ORDINARY, *skip)),
        lambda: train(dumps["guard"], *ORDINARY, *GUARD, env=SPIKES),
        lambda: train(dumps["launch"], *ORDINARY, *skip, env=SPIKES),
        lambda: train(dumps["control"], *COMMON, *skip, "--job.custom_module", "tests.support.skip_without_data",
                      env=SPIKES),  # no workers: they change no bit, and the control is the cheaper
        lambda: (train(dumps["invariant_launch"], *INVARIANT, *skip, nproc=2, env=SPIKES, config=FLUX),
                 _replay(dumps["invariant_launch"], REPLAYED, "--processes", "1")),
        lambda: _stopped_and_resumed(dumps["invariant_guard"], (*INVARIANT, *GUARD), (*INVARIANT, *GUARD), FLUX),
        lambda: (train(dumps["ordinary_2"], *COMMON, *GUARD, "--training.dataset_path", str(tokens), nproc=2,
                       env=SPIKES), _replay(dumps["ordinary_2"], REPLAYED))[0],  # by default at its count, 2
        # One after the other: the second compiles from the first's cache (the same graphs).
        lambda: (train(dumps["compiled_launch"], *COMPILED, *skip, env=SPIKES),
                 train(dumps["compiled_guard"], *COMPILED, *GUARD, env=SPIKES))[1],
        lambda: train(dumps["pipeline_guard"], *PIPELINE, *GUARD, nproc=2, env=SPIKES),
        lambda: train(dumps["pipeline_launch"], *PIPELINE, *skip, nproc=2, env=SPIKES),
    )
    # The skip added at the resume is named, not refused; the guard says what it skipped.
    assert "note: training.skip_steps = '4-5' but checkpoint" in resumed.stdout, resumed.stdout
    for proc in (guarded, guarded_again, guarded_2, compiled, staged):
        assert "spike guard: step 4 skipped (loss " in proc.stdout and "spike guard: step 5" in proc.stdout
    return dumps


@pytest.mark.parametrize(("a", "b"), [("launch", "resume"), ("launch", "guard"),
                                      ("invariant_launch", "invariant_guard"), ("compiled_launch", "compiled_guard"),
                                      ("pipeline_launch", "pipeline_guard")])
def test_a_skip_at_launch_at_a_resume_or_by_the_guard_is_the_same_run(runs: dict[str, Path], a: str, b: str) -> None:
    """(c): bitwise equal losses, and every line the same (gradient norms, learning rates, the skipped flags, the
    samples): the guard decided the steps the others were told, and left out exactly their updates."""
    proc = compare(runs[a], runs[b])
    assert proc.returncode == 0, proc.stdout
    log_a, log_b = read_loss_log(runs[a]), read_loss_log(runs[b])
    assert log_a == log_b
    assert [step for step, record in log_a.items() if record.get("skipped")] == [4, 5]
    assert log_a[4]["loss"] > 1000 and log_a[5]["loss"] > 1000  # the spike reached the step (compiled, staged)
    assert all(float_bits(log_a[s]["grad_norm"]) == float_bits(log_b[s]["grad_norm"]) for s in log_a)
    # Control: the same comparison tells a log one bit away at the last step.
    tampered = {**log_b[STEPS], "loss": float(np.nextafter(log_b[STEPS]["loss"], np.inf))}
    assert compare(runs[a], _with_line(runs[b] / "loss_log.jsonl", tampered)).returncode == 1


def test_a_pipelined_run_logs_each_loader_batch_once(runs: dict[str, Path]) -> None:
    """Both stages load each of a step's two loader batches of 8: the log lists them once, 16 samples a step."""
    for step, record in read_loss_log(runs["pipeline_launch"]).items():
        assert [len(keys) for keys in record["samples"]] == [8, 8], step
        assert len({key for keys in record["samples"] for key in keys}) == 16, step


def _with_line(log: Path, line: dict) -> Path:
    """A copy of the loss log ``log`` with ``line`` appended (the later line of a step counts)."""
    copy = log.with_name("tampered.jsonl")
    copy.write_text(log.read_text() + json.dumps(line) + "\n")
    return copy


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
        integrity.write_checksums(record_file.parent)  # as a streaming run's save would: not damage
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
    returncode, out, err = _replayed(dump)
    logged = read_loss_log(dump)[REPLAYED]
    assert returncode == 0, out + err
    start = dump / "checkpoint" / "step-3"
    assert f"replayed step {REPLAYED} of {dump} on 1 process(es) from checkpoint {start}" in out
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


def test_replay_of_an_ordinary_run_at_its_process_count(runs: dict[str, Path]) -> None:
    """Step 6 of the guarded 2-process ordinary run (FSDP2, a token file), replayed on 2 processes from its
    checkpoint of step 3 (through skipped steps 4-5): the logged loss and gradient norm bit for bit, the mean of
    the two ranks' micro-batch losses is the loss, each micro-batch's samples with their token offsets."""
    dump = runs["ordinary_2"]
    returncode, out, err = _replayed(dump)
    logged = read_loss_log(dump)
    assert returncode == 0, out + err
    start = dump / "checkpoint" / "step-3"
    assert f"replayed step {REPLAYED} of {dump} on 2 process(es) from checkpoint {start}" in out
    assert out.splitlines()[-1] == (f"step {REPLAYED}: loss {logged[REPLAYED]['loss']!r}, grad_norm "
                                    f"{logged[REPLAYED]['grad_norm']!r}, equal to the run's loss log bit for bit")
    assert [step for step, record in logged.items() if record.get("skipped")] == [4, 5]
    lines = [line for line in out.splitlines() if line.startswith("micro-batch ")]
    printed = [[pair.split("@") for pair in line.split("samples ")[1].split()] for line in lines]
    assert [[int(key) for key, _ in batch] for batch in printed] == logged[REPLAYED]["samples"]
    offsets = _offsets(dump, REPLAYED)
    assert [[int(offset) for _, offset in batch] for batch in printed] == offsets
    losses = [torch.tensor(float(line.split()[3])) for line in lines]
    assert len(losses) == 2 and float_bits(float((losses[0] + losses[1]) / 2)) == float_bits(logged[REPLAYED]["loss"])
    assert sum(line.startswith("  grad_norm per block: embed ") for line in out.splitlines()) == 2
    update = next(line for line in out.splitlines() if line.startswith(f"step {REPLAYED}: update norm "))
    assert float(update.split()[4]) > 0


def test_samples_of_a_token_file_show_where_each_sample_lies(runs: dict[str, Path], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Beside each key, the offset of the sample's first token in the file: the window there is the sample the
    trainer builds for the key (``.bin`` from the run, ``.jsonl`` from its config alone); one token off is
    another window (control). A run without a data file prints no offsets."""
    dump = runs["ordinary_2"]
    config = samples.step_samples(dump, 1)[3]
    file_tokens = np.fromfile(config.training.dataset_path, dtype="<u2")
    jsonl = write_jsonl(tmp_path / "data.jsonl")
    jsonl_config = parse_args(["--job.config_file", str(REPO / "train_configs" / "llama_debug.toml"),
                               "--training.dataset_path", str(jsonl)])
    for data, tokens in ((config, file_tokens), (jsonl_config, np.asarray(load_tokens(str(jsonl))))):
        offset_of, dataset = samples.token_offsets(data), get_train_spec(data).build_dataset(data)
        assert offset_of is not None
        for key in (3, 64 + 3, 65):
            offset = offset_of(key)
            assert (key % 64) * WINDOW <= offset < (key % 64 + 1) * WINDOW  # the index's stride, a random shift
            sample = dataset[key]
            assert tokens[offset:offset + WINDOW].tolist() == [*sample["input"].tolist(), int(sample["labels"][-1])]
            assert tokens[offset + 1:offset + 1 + WINDOW].tolist() != tokens[offset:offset + WINDOW].tolist()
    assert samples.main([str(dump), "--step", "2", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["token_offsets"] == _offsets(dump, 2)
    assert samples.main([str(dump), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert f"KEY@OFFSET: the sample's first token is token OFFSET of {config.training.dataset_path}" in out
    first = printed["samples"][0]
    assert f"micro-batch 0: {first[0]}@{printed['token_offsets'][0][0]} {first[1]}@" in out
    assert samples.main([str(runs["launch"]), "--step", "2"]) == 0  # control: the text shipped with Python
    assert "@" not in capsys.readouterr().out
    # A data file not where the record says: the offsets are left out, in one line.
    moved = parse_args(["--job.config_file", str(REPO / "train_configs" / "llama_debug.toml"),
                        "--training.dataset_path", str(tmp_path / "moved.bin")])
    assert samples.token_offsets(moved) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("note: no token offsets: ") and "moved.bin" in err


def _offsets(dump: Path, step: int) -> list[list[int]]:
    keys, _, _, config = samples.step_samples(dump, step)
    offset_of = samples.token_offsets(config)
    assert offset_of is not None
    return [[offset_of(key) for key in batch] for batch in keys]


def test_replay_refuses_another_count_for_an_ordinary_run(runs: dict[str, Path],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """An ordinary run is continued exactly only by the process count that saved it: one line, exit 2, nothing
    trained (the same run replays on 2 processes: the test above)."""
    for processes in ("1", "3"):
        assert replay.main([str(runs["ordinary_2"]), "--step", "5", "--processes", processes]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: --processes {processes} cannot replay this run exactly")
        assert "saved by 2 processes" in err and "(--processes 2)" in err
