"""World-size-invariant training: the same loss log, bit for bit, at 1, 2 and 4 processes, across a resume
at another process count, and in a one-process replay of a multi-process run; llama and flux. (Its pieces:
tests/unit/test_world_size_invariant.py.)"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.checks import assert_refused
from tests.support.launch import compare, together, train
from torchtitan_rng.loss_log import read_loss_log

STEPS = 6
STOP = 3
# 4 micro-batches of 8 per step: 4, 2 or 1 per process at 1, 2 and 4 processes.
INVARIANT = ("--parallelism.world_size_invariant", "--training.global_batch_size", "32",
             "--training.steps", str(STEPS), "--lr_scheduler.total_steps", str(STEPS))
CHECKPOINTED = ("--checkpoint.enable", "--checkpoint.interval", str(STOP))


def _run(dump: Path, config: str, nproc: int, *extra: str) -> Path:
    train(dump, *INVARIANT, *extra, nproc=nproc, config=config)
    return dump


@dataclass
class Runs:
    config: str
    dumps: dict[str, Path]


@pytest.fixture(scope="module", params=["llama_debug", "flux_debug"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Per model: uninterrupted at 1, 2 and 4 processes, those at 1 and 4 also saving a checkpoint at step 3;
    the 4-process checkpoint resumed at 2 processes in a folder of its own, and replayed on 1 process from the
    4-process run's folder (``checkpoint.initial_load_path``)."""
    config = request.param
    folder = tmp_path_factory.mktemp(config)
    dumps = {name: folder / name for name in ("uninterrupted_1", "uninterrupted_2", "uninterrupted_4",
                                              "resumed_4_to_2", "replay")}
    together(lambda: _run(dumps["uninterrupted_1"], config, 1, *CHECKPOINTED),
             lambda: _run(dumps["uninterrupted_2"], config, 2))
    _run(dumps["uninterrupted_4"], config, 4, *CHECKPOINTED)
    _copy_checkpoint(dumps["uninterrupted_4"], dumps["resumed_4_to_2"])
    together(lambda: _run(dumps["resumed_4_to_2"], config, 2, *CHECKPOINTED),
             lambda: _run(dumps["replay"], config, 1, "--checkpoint.enable", "--checkpoint.initial_load_path",
                          str(dumps["uninterrupted_4"] / "checkpoint"), "--checkpoint.load_step", str(STOP)))
    return Runs(config, dumps)


def _copy_checkpoint(source: Path, dump: Path) -> None:
    """A fresh dump folder holding only ``source``'s checkpoint of step STOP."""
    name = f"step-{STOP}"
    shutil.copytree(source / "checkpoint" / name, dump / "checkpoint" / name)


def _assert_continues(reference: Path, resumed: Path) -> None:
    """``resumed`` logged steps STOP+1.. to the end, each with ``reference``'s bits."""
    assert sorted(read_loss_log(resumed)) == list(range(STOP + 1, STEPS + 1))
    result = compare(reference, resumed, "--only-common-steps")
    assert result.returncode == 0, result.stdout


def test_uninterrupted_same_bits_at_1_2_4_processes(runs: Runs) -> None:
    for n in (2, 4):
        result = compare(runs.dumps["uninterrupted_1"], runs.dumps[f"uninterrupted_{n}"])
        assert result.returncode == 0, result.stdout
    assert sorted(read_loss_log(runs.dumps["uninterrupted_4"])) == list(range(1, STEPS + 1))


def test_4_process_checkpoint_resumed_at_2_and_at_1_same_bits(runs: Runs) -> None:
    for resumed in (runs.dumps["resumed_4_to_2"], runs.dumps["replay"]):
        _assert_continues(runs.dumps["uninterrupted_1"], resumed)


def test_replay_on_one_process_from_4_process_checkpoint(runs: Runs) -> None:
    _assert_continues(runs.dumps["uninterrupted_4"], runs.dumps["replay"])


def test_control_ordinary_data_parallelism_differs(runs: Runs, tmp_path: Path) -> None:
    """The comparison can fail: without the mode (per-rank streams, FSDP's reduction), 2 processes training
    the same global batch do not reproduce the invariant run's bits."""
    ordinary = tmp_path / "ordinary"
    train(ordinary, *[a for a in INVARIANT if a != "--parallelism.world_size_invariant"], nproc=2,
          config=runs.config)
    result = compare(runs.dumps["uninterrupted_1"], ordinary)
    assert result.returncode == 1
    assert result.stdout.startswith("first differing step 1:"), result.stdout


def test_one_process_checkpoint_resumes_at_4(runs: Runs, tmp_path: Path) -> None:
    """1 -> 4: a checkpoint of one process continues at four processes on the same bits."""
    _copy_checkpoint(runs.dumps["uninterrupted_1"], tmp_path)
    _run(tmp_path, runs.config, 4, *CHECKPOINTED)
    _assert_continues(runs.dumps["uninterrupted_4"], tmp_path)


def test_checkpoint_mode_mismatch_refused_in_one_line(runs: Runs, tmp_path: Path) -> None:
    saved = runs.dumps["uninterrupted_4"] / "checkpoint"
    common = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(saved), "--checkpoint.load_step",
              str(STOP), "--training.steps", "5"]
    without, other_batch = together(
        lambda: train(tmp_path / "without", *common, config=runs.config, check=False),
        lambda: train(tmp_path / "other", *INVARIANT, *common, "--training.global_batch_size", "16",
                      config=runs.config, check=False))
    assert_refused(without, "resume it with --parallelism.world_size_invariant")
    assert_refused(other_batch, "training.global_batch_size = 16 but checkpoint")  # the run record refuses it


def test_launcher_refuses_a_process_count_that_does_not_split_the_step(tmp_path: Path) -> None:
    """Checked before torchrun starts any process: 2 processes cannot split 3 micro-batches."""
    proc = train(tmp_path, *INVARIANT, "--training.global_batch_size", "24", nproc=2, check=False)
    assert_refused(proc, "power-of-two number of processes that divides the 3 micro-batches")
    assert not (tmp_path / "loss_log.jsonl").exists()


def test_bf16_compile_and_ac_same_bits_at_1_and_2_processes(tmp_path: Path) -> None:
    """The mode with the features of real runs: bf16 (autocast on every process: nothing shards, so nothing
    casts the parameters), torch.compile and selective activation checkpointing. Control: the same run in
    float32 differs, so bf16 was applied and not silently dropped."""
    features = ("--training.mixed_precision_param", "bfloat16", "--compile.enable",
                "--activation_checkpoint.mode", "selective")
    dumps = {name: tmp_path / name for name in ("one", "two", "float32")}
    together(lambda: _run(dumps["one"], "llama_debug", 1, *features),
             lambda: _run(dumps["two"], "llama_debug", 2, *features),
             lambda: _run(dumps["float32"], "llama_debug", 1, *features[2:]))
    result = compare(dumps["one"], dumps["two"])
    assert result.returncode == 0, result.stdout
    assert sorted(read_loss_log(dumps["two"])) == list(range(1, STEPS + 1))
    control = compare(dumps["one"], dumps["float32"])
    assert control.returncode == 1 and control.stdout.startswith("first differing step 1:"), control.stdout
