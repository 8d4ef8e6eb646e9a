"""World-size-invariant training, sharded: the same loss log, bit for bit, at 1, 2, 3 and 4 processes, across a
resume at another process count (4 -> 3, 3 -> 2), and in a one-process replay of a 3-process checkpoint; llama
and flux. (Its pieces: tests/unit/test_world_size_invariant.py.)"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from tests.support.checks import assert_refused
from tests.support.launch import compare, together, train
from torchtitan_rng.loss_log import read_loss_log

STEPS = 4
STOP = 2
# 12 micro-batches of 2 per step: 12, 6, 4 or 3 per process at 1, 2, 3 and 4 processes.
INVARIANT = ("--parallelism.world_size_invariant", "--training.local_batch_size", "2",
             "--training.global_batch_size", "24", "--training.steps", str(STEPS),
             "--lr_scheduler.total_steps", str(STEPS))
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
    """Per model: uninterrupted at 1, 2, 3 and 4 processes, those at 3 and 4 also saving a checkpoint at step
    STOP; then, side by side, the 4-process checkpoint resumed at 3 processes and the 3-process one at 2, each in
    a folder of its own, and the 3-process run replayed on 1 process from its folder
    (``checkpoint.initial_load_path``)."""
    config = request.param
    folder = tmp_path_factory.mktemp(config)
    dumps = {name: folder / name for name in ("uninterrupted_1", "uninterrupted_2", "uninterrupted_3",
                                              "uninterrupted_4", "resumed_4_to_3", "resumed_3_to_2", "replay")}
    together(lambda: _run(dumps["uninterrupted_1"], config, 1),
             lambda: _run(dumps["uninterrupted_2"], config, 2),
             lambda: _run(dumps["uninterrupted_3"], config, 3, *CHECKPOINTED),
             lambda: _run(dumps["uninterrupted_4"], config, 4, *CHECKPOINTED))
    _copy_checkpoint(dumps["uninterrupted_4"], dumps["resumed_4_to_3"])
    _copy_checkpoint(dumps["uninterrupted_3"], dumps["resumed_3_to_2"])
    together(lambda: _run(dumps["resumed_4_to_3"], config, 3, *CHECKPOINTED),
             lambda: _run(dumps["resumed_3_to_2"], config, 2, *CHECKPOINTED),
             lambda: _run(dumps["replay"], config, 1, "--checkpoint.enable", "--checkpoint.initial_load_path",
                          str(dumps["uninterrupted_3"] / "checkpoint"), "--checkpoint.load_step", str(STOP)))
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


def test_uninterrupted_same_bits_at_1_2_3_4_processes(runs: Runs) -> None:
    for n in (2, 3, 4):
        result = compare(runs.dumps["uninterrupted_1"], runs.dumps[f"uninterrupted_{n}"])
        assert result.returncode == 0, result.stdout
    assert sorted(read_loss_log(runs.dumps["uninterrupted_3"])) == list(range(1, STEPS + 1))


def test_stopped_at_4_resumed_at_3_and_stopped_at_3_resumed_at_2_same_bits(runs: Runs) -> None:
    for resumed in ("resumed_4_to_3", "resumed_3_to_2"):
        _assert_continues(runs.dumps["uninterrupted_1"], runs.dumps[resumed])


def test_replay_on_one_process_from_3_process_checkpoint(runs: Runs) -> None:
    _assert_continues(runs.dumps["uninterrupted_3"], runs.dumps["replay"])


def test_checkpoint_is_sharded_over_the_processes_that_saved_it(runs: Runs) -> None:
    """Each of the 4 processes saved only its slice of a weight (and of its optimizer moments): FSDP2 shards."""
    metadata = FileSystemReader(str(runs.dumps["uninterrupted_4"] / "checkpoint" / f"step-{STOP}")).read_metadata()
    chunks = {key: len(item.chunks) for key, item in metadata.state_dict_metadata.items()
              if hasattr(item, "chunks") and len(item.size) == 2}
    weights = [key for key in chunks if key.startswith("model.")]
    moments = [key for key in chunks if key.startswith("optimizer.") and key.endswith("exp_avg")]
    assert weights and moments, sorted(chunks)[:10]
    assert all(chunks[key] == 4 for key in weights + moments), chunks


def test_control_ordinary_data_parallelism_differs_across_counts(runs: Runs, tmp_path: Path) -> None:
    """The comparison can fail: without the mode (per-rank streams, FSDP2's own reduce-scatter), 2 and 3
    processes training the same global batch do not reproduce each other's bits, nor the invariant run's."""
    ordinary = [a for a in INVARIANT if a != "--parallelism.world_size_invariant"]
    dumps = together(*(lambda n=n: _run_ordinary(tmp_path / f"ordinary_{n}", runs.config, n, ordinary)
                       for n in (2, 3)))
    for a, b in ((dumps[0], dumps[1]), (runs.dumps["uninterrupted_1"], dumps[1])):
        result = compare(a, b)
        assert result.returncode == 1
        assert result.stdout.startswith("first differing step 1:"), result.stdout


def _run_ordinary(dump: Path, config: str, nproc: int, args: list[str]) -> Path:
    train(dump, *args, nproc=nproc, config=config)
    return dump


def test_checkpoint_mode_mismatch_refused_in_one_line(runs: Runs, tmp_path: Path) -> None:
    saved = runs.dumps["uninterrupted_4"] / "checkpoint"
    common = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(saved), "--checkpoint.load_step",
              str(STOP), "--training.steps", "3"]
    without, other_batch = together(
        lambda: train(tmp_path / "without", *common, config=runs.config, check=False),
        lambda: train(tmp_path / "other", *INVARIANT, *common, "--training.global_batch_size", "12",
                      config=runs.config, check=False))
    assert_refused(without, "resume it with --parallelism.world_size_invariant")
    assert_refused(other_batch, "training.global_batch_size = 12 but checkpoint")  # the run record refuses it


def test_launcher_refuses_a_process_count_that_does_not_split_the_step(tmp_path: Path) -> None:
    """Checked before torchrun starts any process: 4 processes cannot split 6 micro-batches."""
    proc = train(tmp_path, *INVARIANT, "--training.global_batch_size", "12", nproc=4, check=False)
    assert_refused(proc, "divides the 6 micro-batches per step", "use 1, 2, 3, 6")
    assert not (tmp_path / "loss_log.jsonl").exists()


def test_bf16_compile_and_ac_same_bits_at_1_and_3_processes(tmp_path: Path) -> None:
    """The mode with the features of real runs: bf16 (autocast on every process; FSDP2 gathers float32
    parameters, so one process and three compute alike), torch.compile and selective activation
    checkpointing. Control: the same run in float32 differs, so bf16 was applied and not silently dropped."""
    features = ("--training.mixed_precision_param", "bfloat16", "--compile.enable",
                "--activation_checkpoint.mode", "selective", "--training.steps", "2")
    dumps = {name: tmp_path / name for name in ("one", "three", "float32")}
    together(lambda: _run(dumps["one"], "llama_debug", 1, *features),
             lambda: _run(dumps["three"], "llama_debug", 3, *features),
             lambda: _run(dumps["float32"], "llama_debug", 1, *features[2:]))
    result = compare(dumps["one"], dumps["three"])
    assert result.returncode == 0, result.stdout
    assert sorted(read_loss_log(dumps["three"])) == [1, 2]
    control = compare(dumps["one"], dumps["float32"])
    assert control.returncode == 1 and control.stdout.startswith("first differing step 1:"), control.stdout
