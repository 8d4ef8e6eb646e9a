"""Pipeline parallelism without training: which plan a config gets, how layers split into stages and stages
over ranks, the one-line refusals of what cannot run, and a layout change at a resume refused by the run
record, one line per key."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.support.launch import REPO
from torchtitan_rng import resume
from torchtitan_rng.checkpoint import run_record
from torchtitan_rng.checkpoint.layout import TRAIN_STATE, rank_key
from torchtitan_rng.checkpoint.dcp_io import inspect_checkpoint
from torchtitan_rng.checkpoint.manager import CheckpointManager
from torchtitan_rng.checkpoint.states import ModelState
from torchtitan_rng.errors import CheckpointError
from torchtitan_rng.config import ConfigError, JobConfig, parse_args
from torchtitan_rng.distributed import data_parallel_degree
from torchtitan_rng.launch import preflight
from torchtitan_rng.models import get_train_spec
from torchtitan_rng.parallel import Mode, mode_of
from torchtitan_rng.parallel.layout import FlatLayout
from torchtitan_rng.parallel.numerics import CarriedNumerics
from torchtitan_rng.parallel.pipeline import StagedLayout, stage_layers, stages_of_rank
from torchtitan_rng.sample_log import in_slot_order

CONFIG = str(REPO / "train_configs" / "llama_debug.toml")


def _config(*overrides: str) -> JobConfig:
    return parse_args(["--job.config_file", CONFIG, *overrides])


def _pp(degree: int, schedule: str, *overrides: str) -> JobConfig:
    return _config("--parallelism.pipeline_parallel_degree", str(degree),
                   "--parallelism.pipeline_parallel_schedule", schedule, *overrides)


DATA_PARALLEL, PIPELINE = Mode(FlatLayout, CarriedNumerics), Mode(StagedLayout, CarriedNumerics)


def test_the_plan_is_staged_from_degree_2() -> None:
    assert mode_of(_config().parallelism) == DATA_PARALLEL
    assert mode_of(_pp(2, "1F1B").parallelism) == PIPELINE


@pytest.mark.parametrize(("schedule", "layers", "split", "expected"), [
    ("1F1B", 2, (), [[0], [1]]),
    ("GPipe", 5, (), [[0, 1, 2], [3, 4]]),
    ("Interleaved1F1B", 4, (), [[0], [1], [2], [3]]),
    ("1F1B", 4, ("layers.1",), [[0], [1, 2, 3]]),
])
def test_layers_split_evenly_or_at_the_split_points(schedule: str, layers: int, split: tuple[str, ...],
                                                    expected: list[list[int]]) -> None:
    overrides = ("--parallelism.pipeline_parallel_split_points", ",".join(split)) if split else ()
    assert stage_layers(_pp(2, schedule, *overrides).parallelism, layers) == expected


def test_stages_over_ranks_looped_and_v() -> None:
    looped = _pp(2, "Interleaved1F1B").parallelism
    assert [stages_of_rank(looped, rank) for rank in (0, 1)] == [[0, 2], [1, 3]]
    v_shape = _pp(2, "ZBVZeroBubble").parallelism
    assert [stages_of_rank(v_shape, rank) for rank in (0, 1)] == [[0, 3], [1, 2]]


@pytest.mark.parametrize(("config", "world_size", "fragment"), [
    (_pp(2, "1F1B"), 3, "does not divide the 3 processes started"),
    (_pp(2, "1F1B", "--parallelism.pipeline_parallel_microbatch_size", "3"), 2, "does not divide "
     "training.local_batch_size = 8"),
    (_pp(2, "1F1B", "--parallelism.pipeline_parallel_split_points", "layers.1,layers.2"), 2, "runs one stage per "
     "rank, and 3 stages"),
    (_pp(2, "Interleaved1F1B", "--parallelism.pipeline_parallel_split_points", "layers.1"), 2, "two or more "
     "stages per rank"),
    (_pp(2, "1F1B", "--parallelism.pipeline_parallel_split_points", "block.1"), 2, "a split point is layers.N"),
    (_pp(2, "1F1B", "--validation.enable"), 2, "turn validation off"),
])
def test_what_cannot_run_is_refused_in_one_line(config: JobConfig, world_size: int, fragment: str) -> None:
    with pytest.raises(ConfigError) as refused:
        PIPELINE.check_config(config, world_size)
    assert "\n" not in str(refused.value) and fragment in str(refused.value), str(refused.value)


@pytest.mark.parametrize(("shard", "pp", "world_size", "dp"), [(2, 2, 4, 2), (-1, 2, 4, 2), (-1, 1, 4, 4), (4, 1, 4, 4),
                                                              (1, 4, 4, 1)])
def test_shard_degree_times_pipeline_degree_is_the_process_count(shard: int, pp: int, world_size: int,
                                                                  dp: int) -> None:
    """torchtitan's meaning: data_parallel_shard_degree x pipeline_parallel_degree = processes, -1 fills; the
    launcher's check (the plan's) accepts what the rule accepts."""
    config = _pp(pp, "1F1B", "--parallelism.data_parallel_shard_degree", str(shard))
    assert data_parallel_degree(config.parallelism, world_size) == dp
    mode_of(config.parallelism).check_config(config, world_size)


@pytest.mark.parametrize(("shard", "pp", "world_size", "fragment"), [
    (4, 2, 4, "data_parallel_shard_degree = 4 x pipeline_parallel_degree = 2 is 8 processes, but 4 were started"),
    (2, 1, 4, "data_parallel_shard_degree = 2 x pipeline_parallel_degree = 1 is 2 processes, but 4 were started"),
    (-1, 2, 3, "pipeline_parallel_degree = 2 does not divide the 3 processes started"),
    (0, 2, 4, "data_parallel_shard_degree = 0"),
])
def test_a_shard_degree_that_does_not_fill_the_processes_is_refused_in_one_line(shard: int, pp: int, world_size: int,
                                                                                fragment: str) -> None:
    """Control of the rule above: the old reading (-1 or the process count) would take 4 with pp 2 on 4."""
    config = _pp(pp, "1F1B", "--parallelism.data_parallel_shard_degree", str(shard))
    for check in (lambda: data_parallel_degree(config.parallelism, world_size),
                  lambda: mode_of(config.parallelism).check_config(config, world_size)):
        with pytest.raises(ConfigError) as refused:
            check()
        assert "\n" not in str(refused.value) and fragment in str(refused.value), str(refused.value)


def test_too_few_layers_for_the_stages_is_refused() -> None:
    """Split points named: the refusal names them."""
    with pytest.raises(ConfigError, match="^the model has 2 layers, too few for 3 pipeline stages with split points "
                                          "layers.1, layers.2: every stage needs a layer"):
        stage_layers(_pp(2, "Interleaved1F1B", "--parallelism.pipeline_parallel_split_points",
                         "layers.1,layers.2").parallelism, 2)


def test_too_few_layers_for_an_interleaved_default_names_the_schedule_and_the_fix() -> None:
    """Interleaved1F1B on the default model, no split points given: the refusal says where the four stages come
    from and names the model's fix (the spec's deeper flavor), which then runs; no split point is named."""
    config = _pp(2, "Interleaved1F1B")
    deeper = get_train_spec(config).pipeline.deeper(4)
    assert deeper == "--model.flavor debug4"
    with pytest.raises(ConfigError) as refused:
        stage_layers(config.parallelism, 2, deeper)
    assert str(refused.value) == (
        "the model has 2 layers, too few for the 4 pipeline stages parallelism.pipeline_parallel_schedule = "
        "'Interleaved1F1B' runs over parallelism.pipeline_parallel_degree = 2 (two per rank): every stage needs a "
        "layer; pass --model.flavor debug4, or --parallelism.pipeline_parallel_schedule 1F1B (one stage per rank)")
    followed = _pp(2, "Interleaved1F1B", *deeper.split())
    PIPELINE.check_config(followed, 2)
    assert stage_layers(followed.parallelism, 4) == [[0], [1], [2], [3]]


def test_a_model_that_does_not_split_is_refused_once_for_all_it_needs() -> None:
    """Flux (validation on in its config) with stages: one line, the one change that runs it (pp 1), before
    the validation refusal that pp 1 also lifts."""
    config = parse_args(["--job.config_file", str(REPO / "train_configs" / "flux_debug.toml"),
                         "--parallelism.pipeline_parallel_degree", "2"])
    assert config.validation.enable
    with pytest.raises(ConfigError) as refused:
        PIPELINE.check_config(config, 2)
    assert str(refused.value) == ("config parallelism.pipeline_parallel_degree = 2: model 'flux' does not split into "
                                  "pipeline stages (its train spec has no pipeline split); run it with "
                                  "--parallelism.pipeline_parallel_degree 1")
    followed = parse_args(["--job.config_file", str(REPO / "train_configs" / "flux_debug.toml"),
                           "--parallelism.pipeline_parallel_degree", "1"])
    mode_of(followed.parallelism).check_config(followed, 1)


class _Samples:
    def __len__(self) -> int:
        return 64


DEBUG4 = ("--model.flavor", "debug4")  # four layers: split evenly over two stages at layers.2


def _resumed(saved: JobConfig, config: JobConfig, allowed: tuple[str, ...] = ()) -> list[str]:
    """What a resume of a checkpoint trained with ``saved`` says when run with ``config`` (its run record's
    verdict, the config seen as the resume's parallel mode sees it)."""
    return run_record.check_resume(Path("ckpt/step-2"), resume.build_record(saved, _Samples()),
                                   resume.build_record(config, _Samples()), list(allowed),
                                   compared=resume.compared_by(config))


@pytest.mark.parametrize(("flag", "value"), [
    ("--parallelism.pipeline_parallel_degree", "1"),
    ("--parallelism.pipeline_parallel_schedule", "GPipe"),
    ("--parallelism.pipeline_parallel_microbatch_size", "2"),
    ("--parallelism.pipeline_parallel_split_points", "layers.1"),
])
def test_a_layout_change_at_resume_is_refused_in_one_line(flag: str, value: str) -> None:
    """A checkpoint of pp 2 under 1F1B continued with another degree, schedule, micro-batch size or split: one
    line naming the key and the opt-in, which then names the change in a WARNING."""
    key = flag[2:]
    with pytest.raises(run_record.ConfigDriftError) as refused:
        _resumed(_pp(2, "1F1B", *DEBUG4), _pp(2, "1F1B", *DEBUG4, flag, value))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{key} = ") and \
        f"--checkpoint.allow_config_change {key}" in message, message
    warnings = _resumed(_pp(2, "1F1B", *DEBUG4), _pp(2, "1F1B", *DEBUG4, flag, value), (key,))
    assert len(warnings) == 1 and warnings[0].startswith(f"WARNING: {key} = "), warnings


def test_a_split_named_as_the_default_made_it_is_the_same_layout() -> None:
    """The default split of two layers over two stages is layers.1: naming it at a resume changes nothing, and
    the reverse; control above: layers.1 on four layers (default layers.2) is refused, naming both splits."""
    named = ("--parallelism.pipeline_parallel_split_points", "layers.1")
    assert _resumed(_pp(2, "1F1B"), _pp(2, "1F1B", *named)) == []
    assert _resumed(_pp(2, "1F1B", *named), _pp(2, "1F1B")) == []
    with pytest.raises(run_record.ConfigDriftError, match=r"^parallelism.pipeline_parallel_split_points = "
                       r"\['layers.1'\] but checkpoint ckpt/step-2 was trained with \['layers.2'\]: "):
        _resumed(_pp(2, "1F1B", *DEBUG4), _pp(2, "1F1B", *DEBUG4, *named))


def test_without_stages_the_stage_keys_are_not_compared() -> None:
    """A resume without stages names no micro-batch size, schedule or split: they mean nothing there. pp 2 -> 1
    names the degree alone; pp 1 -> 1 with other stage keys names nothing."""
    stage_keys = ("--parallelism.pipeline_parallel_microbatch_size", "2", "--parallelism.pipeline_parallel_schedule",
                  "GPipe")
    with pytest.raises(run_record.ConfigDriftError) as refused:
        _resumed(_pp(2, "1F1B", *stage_keys), _pp(1, "1F1B"))
    assert str(refused.value).startswith("parallelism.pipeline_parallel_degree = 1 but checkpoint ckpt/step-2 was "
                                         "trained with 2: "), str(refused.value)
    assert "microbatch" not in str(refused.value) and "schedule" not in str(refused.value)
    assert _resumed(_pp(1, "1F1B", *stage_keys), _pp(1, "1F1B")) == []


def test_a_resume_through_preflight_compares_the_resolved_split(tmp_path: Path) -> None:
    """The launcher's check of a real checkpoint folder (the one vetting the trainer runs too): a run of the
    default split resumed with it named goes on; control: another split is refused."""
    def config(*flags: str) -> JobConfig:
        return _pp(2, "1F1B", "--job.dump_folder", str(tmp_path), "--checkpoint.enable", *flags)

    for flavor, named in (("debug", "layers.1"), ("debug4", "layers.1")):
        shutil.rmtree(tmp_path, ignore_errors=True)
        trained = config("--model.flavor", flavor)
        manager = CheckpointManager(resume.folder_of(trained), {"model": ModelState(torch.nn.Linear(4, 4))},
                                    interval=1, log=lambda line: None)
        manager.run_record = resume.build_record(trained, get_train_spec(trained).build_dataset(trained))
        manager.save(2, last_step=2)
        manager.close()
        resumed = config("--model.flavor", flavor, "--parallelism.pipeline_parallel_split_points", named)
        if flavor == "debug":
            assert preflight.check(resumed) == tmp_path / "checkpoint" / "step-2"
        else:
            with pytest.raises(run_record.ConfigDriftError, match="^parallelism.pipeline_parallel_split_points"):
                preflight.check(resumed)


def test_another_process_count_is_refused_even_with_reseed(tmp_path: Path) -> None:
    """A checkpoint of 4 processes resumed by 2: ordinary data parallelism may reseed, stages may not (the
    reseeded data split counts processes, not data-parallel ranks)."""
    dcp.save({TRAIN_STATE: {rank_key(rank): torch.tensor(rank) for rank in range(4)}}, checkpoint_id=str(tmp_path))
    info = inspect_checkpoint(tmp_path)
    assert DATA_PARALLEL.check_checkpoint(info, 2, "reseed") is True
    with pytest.raises(CheckpointError) as refused:
        PIPELINE.check_checkpoint(info, 2, "reseed")
    assert "saved by 4 processes and this run has 2" in str(refused.value)
    assert "reseed" not in str(refused.value)
    assert PIPELINE.check_checkpoint(info, 4, "reseed") is False


def test_sample_keys_are_those_of_each_data_parallel_column_once() -> None:
    """pp 2 x dp 2: column 0 (ranks 0 and 2) loads what rank 0 of two processes without stages would, column 1
    (ranks 1 and 3) rank 1's; each column's batches are listed once, not once per stage."""
    config = _pp(2, "1F1B")
    assert PIPELINE.step_sample_keys(config, 64, 4, 3) == DATA_PARALLEL.step_sample_keys(config, 64, 2, 3)
    assert len(PIPELINE.step_sample_keys(config, 64, 4, 3)) == 2


def test_the_log_lists_each_data_shards_batches_once_in_slot_order() -> None:
    """What rank 0 writes from the four ranks of pp 2 x dp 2 (rank = pp_rank x dp + dp_rank; both stages of a
    column load the same batches), two loader batches each: one entry per batch of the step, by the plan's slot:
    shard-major in the ordinary mode, the mode's round-robin slot in the invariant one."""
    columns = {0: [[0, 1], [2, 3]], 1: [[4, 5], [6, 7]]}
    loaded = [(rank % 2, columns[rank % 2]) for rank in range(4)]
    assert in_slot_order(loaded, lambda shard, index: shard * 2 + index) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert in_slot_order(loaded, lambda shard, index: index * 2 + shard) == [[0, 1], [4, 5], [2, 3], [6, 7]]
