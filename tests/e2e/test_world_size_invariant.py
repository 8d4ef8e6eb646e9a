"""World-size-invariant training, sharded: the same loss log, bit for bit, at 1, 2, 3 and 4 processes, across a
resume at another process count (4 -> 3, 3 -> 2), and in a one-process replay of a 3-process checkpoint; llama
and flux (flux in the slow tier). (Its pieces: tests/unit/test_world_size_invariant.py.)"""

from __future__ import annotations

import shutil
from collections.abc import Callable
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


# Flux's runs: the slow tier, which CI runs (on the newest torch too); llama's every day.
MODELS = ("llama_debug", pytest.param("flux_debug", marks=pytest.mark.slow))
RUN_NAMES = ("uninterrupted_1", "uninterrupted_2", "uninterrupted_3", "uninterrupted_4", "resumed_4_to_3",
             "resumed_3_to_2", "replay")


def _model_runs(config: str, dumps: dict[str, Path]) -> None:
    """Uninterrupted at 1, 2, 3 and 4 processes side by side, those at 3 and 4 also saving a checkpoint at step
    STOP; then, side by side, the 4-process checkpoint resumed at 3 processes and the 3-process one at 2, each
    in a folder of its own, and the 3-process run replayed on 1 process from its folder
    (``checkpoint.initial_load_path``)."""
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


def _model_fixture(config: str) -> Callable[[pytest.TempPathFactory], dict[str, Path]]:
    @pytest.fixture(scope="module")
    def model_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
        """The model's dump folders by run name (:func:`_model_runs`)."""
        folder = tmp_path_factory.mktemp(config)
        dumps = {name: folder / name for name in RUN_NAMES}
        _model_runs(config, dumps)
        return dumps
    return model_runs


llama_debug_runs = _model_fixture("llama_debug")
flux_debug_runs = _model_fixture("flux_debug")


class _Runs(dict):
    """Each model's runs, made once per module (its fixture) when a test first reads them."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        super().__init__()
        self.request = request

    def __missing__(self, config: str) -> dict[str, Path]:
        return self.setdefault(config, self.request.getfixturevalue(f"{config}_runs"))


@pytest.fixture
def runs(request: pytest.FixtureRequest) -> dict[str, dict[str, Path]]:
    return _Runs(request)


def _copy_checkpoint(source: Path, dump: Path) -> None:
    """A fresh dump folder holding only ``source``'s checkpoint of step STOP."""
    name = f"step-{STOP}"
    shutil.copytree(source / "checkpoint" / name, dump / "checkpoint" / name)


def _assert_continues(reference: Path, resumed: Path) -> None:
    """``resumed`` logged steps STOP+1.. to the end, each with ``reference``'s bits."""
    assert sorted(read_loss_log(resumed)) == list(range(STOP + 1, STEPS + 1))
    result = compare(reference, resumed, "--only-common-steps")
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("config", MODELS)
def test_uninterrupted_same_bits_at_1_2_3_4_processes(runs: dict[str, dict[str, Path]], config: str) -> None:
    dumps = runs[config]
    for n in (2, 3, 4):
        result = compare(dumps["uninterrupted_1"], dumps[f"uninterrupted_{n}"])
        assert result.returncode == 0, result.stdout
    assert sorted(read_loss_log(dumps["uninterrupted_3"])) == list(range(1, STEPS + 1))


@pytest.mark.parametrize("config", MODELS)
def test_stopped_at_4_resumed_at_3_and_stopped_at_3_resumed_at_2_same_bits(runs: dict[str, dict[str, Path]],
                                                                           config: str) -> None:
    for resumed in ("resumed_4_to_3", "resumed_3_to_2"):
        _assert_continues(runs[config]["uninterrupted_1"], runs[config][resumed])


@pytest.mark.parametrize("config", MODELS)
def test_replay_on_one_process_from_3_process_checkpoint(runs: dict[str, dict[str, Path]], config: str) -> None:
    _assert_continues(runs[config]["uninterrupted_3"], runs[config]["replay"])


@pytest.mark.parametrize("config", MODELS)
def test_checkpoint_is_sharded_over_the_processes_that_saved_it(runs: dict[str, dict[str, Path]],
                                                                config: str) -> None:
    """Each of the 4 processes saved only its slice of every trained matrix and of its optimizer moments
    (FSDP2 shards them); flux's frozen encoders are whole (no process trains them)."""
    step = runs[config]["uninterrupted_4"] / "checkpoint" / f"step-{STOP}"
    metadata = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    moments = [key for key in metadata if key.startswith("optimizer.") and key.endswith(".exp_avg")
               and len(metadata[key].size) == 2]
    weights = ["model." + key.removeprefix("optimizer.state.").removesuffix(".exp_avg") for key in moments]
    assert moments and all(key in metadata for key in weights), moments[:3]
    assert all(len(metadata[key].chunks) == 4 for key in weights + moments)


def test_control_ordinary_data_parallelism_differs(runs: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    """The comparison can fail: without the mode (per-rank streams, FSDP2's own reduce-scatter), 3 processes
    training the same global batch do not reproduce the invariant run's bits. (The reduction alone, FSDP2-style
    partial sums all-reduced against the slot-order exchange: tests/unit/test_world_size_invariant.py.)"""
    ordinary = tmp_path / "ordinary"
    train(ordinary, *[a for a in INVARIANT if a != "--parallelism.world_size_invariant"], nproc=3)
    result = compare(runs["llama_debug"]["uninterrupted_3"], ordinary)
    assert result.returncode == 1
    assert result.stdout.startswith("first differing step 1:"), result.stdout


def test_checkpoint_mode_mismatch_refused_in_one_line(runs: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    saved = runs["llama_debug"]["uninterrupted_4"] / "checkpoint"
    common = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(saved), "--checkpoint.load_step",
              str(STOP), "--training.steps", "3"]
    without, other_batch = together(
        lambda: train(tmp_path / "without", *common, check=False),
        lambda: train(tmp_path / "other", *INVARIANT, *common, "--training.global_batch_size", "12", check=False))
    assert_refused(without, "resume it with --parallelism.world_size_invariant")
    assert_refused(other_batch, "training.global_batch_size = 12 but checkpoint")  # the run record refuses it


def test_launcher_refuses_a_process_count_that_does_not_split_the_step(tmp_path: Path) -> None:
    """Checked before torchrun starts any process: 4 processes cannot split 6 micro-batches."""
    proc = train(tmp_path, *INVARIANT, "--training.global_batch_size", "12", nproc=4, check=False)
    assert_refused(proc, "divides the 6 micro-batches per step", "use 1, 2, 3, 6")
    assert not (tmp_path / "loss_log.jsonl").exists()


@pytest.mark.slow  # CI's tier: compiling costs minutes of CPU
def test_bf16_compile_and_ac_same_bits_at_1_and_2_processes(tmp_path: Path) -> None:
    """The mode with the features of real runs: bf16 (autocast on every process; FSDP2 gathers float32
    parameters, so one process and two compute alike), torch.compile and selective activation
    checkpointing. Control: the same run in float32 differs, so bf16 was applied and not silently dropped."""
    features = ("--training.mixed_precision_param", "bfloat16", "--compile.enable",
                "--activation_checkpoint.mode", "selective", "--training.steps", "2")
    dumps = {name: tmp_path / name for name in ("one", "two", "float32")}
    # The one-process run first: it fills inductor's cache, which the two ranks then compile from instead of
    # both compiling its graphs at once (the float32 control's graphs are its own).
    _run(dumps["one"], "llama_debug", 1, *features)
    together(lambda: _run(dumps["two"], "llama_debug", 2, *features),
             lambda: _run(dumps["float32"], "llama_debug", 1, *features[2:]))
    result = compare(dumps["one"], dumps["two"])
    assert result.returncode == 0, result.stdout
    assert sorted(read_loss_log(dumps["two"])) == [1, 2]
    control = compare(dumps["one"], dumps["float32"])
    assert control.returncode == 1 and control.stdout.startswith("first differing step 1:"), control.stdout
