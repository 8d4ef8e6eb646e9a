"""World-size-invariant training: the same loss log, bit for bit, at 1, 2 and 4 processes, across a resume
at another process count, and in a one-process replay of a multi-process run."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from checks import assert_refused
from launch import compare, together, train
from torchtitan_rng.config import ConfigError, parse_args
from torchtitan_rng.data.global_sampler import GlobalBatchSampler
from torchtitan_rng.parallel.invariant.reduction import butterfly_sum, tree_sum
from torchtitan_rng.parallel.invariant.setup import plan_layout
from torchtitan_rng.loss_log import read_loss_log
from torchtitan_rng.models.llama.spec import build_text_dataset

STEPS = 6
STOP = 3
# 4 micro-batches of 8 per step: 4, 2 or 1 per process at 1, 2 and 4 processes.
INVARIANT = ("--parallelism.world_size_invariant", "--training.global_batch_size", "32",
             "--training.steps", str(STEPS), "--lr_scheduler.total_steps", str(STEPS))
CHECKPOINTED = ("--checkpoint.enable", "--checkpoint.interval", str(STOP))


# --- pieces, in-process and with real gloo processes -------------------------------------------------------

def test_global_sampler_places_micro_batches_by_global_position() -> None:
    """Slot j of step t holds the same keys whatever the process count; rank r takes a contiguous block."""
    def slots(world: int) -> list[list[int]]:
        samplers = [GlobalBatchSampler(20, 3, 4, rank, world, seed=7) for rank in range(world)]
        per_step = [[next(s) for _ in range(4 // world)] for _ in range(5) for s in samplers]
        return [batch for block in per_step for batch in block]

    single = slots(1)
    assert slots(2) == single and slots(4) == single
    assert len({key for batch in single for key in batch}) > 20  # crosses epochs: keys carry the epoch
    resumed = GlobalBatchSampler(20, 3, 4, 1, 2, seed=7)
    resumed.load_state_dict({"step": 3, "slot": 0})
    assert next(resumed) == single[3 * 4 + 2]  # step 3, slot 2: rank 1's first of 2
    assert GlobalBatchSampler(20, 3, 4, 0, 1, seed=8).keys_of(0, 0) != single[0]  # control: another seed


def _sum_worker(rank: int, world: int, store: str, leaves: torch.Tensor, out: str) -> None:
    """This rank's block of leaves summed twice: in the canonical tree, and in order then one all-reduce."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    per_rank = len(leaves) // world
    first = rank * per_rank
    canonical = butterfly_sum(tree_sum(first, first + per_rank, lambda j: leaves[j].clone()), rank, world)
    plain = leaves[first : first + per_rank].sum(0)
    dist.all_reduce(plain)
    torch.save({"canonical": canonical, "plain": plain}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_canonical_sum_same_bits_on_4_processes_as_on_one_plain_all_reduce_differs(tmp_path: Path) -> None:
    leaves = torch.randn(8, 4096, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 4096)
    one_process = tree_sum(0, 8, lambda j: leaves[j].clone()).view(torch.int32)
    mp.spawn(_sum_worker, args=(4, str(tmp_path / "store"), leaves, str(tmp_path / "sum")), nprocs=4)
    sums = [torch.load(tmp_path / f"sum.{rank}") for rank in range(4)]
    assert all(torch.equal(s["canonical"].view(torch.int32), one_process) for s in sums)
    assert not torch.equal(sums[0]["plain"].view(torch.int32), one_process)  # the control


def test_constraints_are_one_line_config_errors() -> None:
    dataset = build_text_dataset(parse_args([]))

    def refusal(world: int, *args: str) -> str:
        with pytest.raises(ConfigError) as err:
            plan_layout(parse_args(["--parallelism.world_size_invariant", *args]), 0, world, dataset)
        assert "\n" not in str(err.value)
        return str(err.value)

    assert "needs training.global_batch_size" in refusal(1)
    assert "not a multiple of training.local_batch_size" in refusal(1, "--training.global_batch_size", "20")
    assert "power-of-two number of processes" in refusal(3, "--training.global_batch_size", "48")
    assert "divides the 2 micro-batches" in refusal(4, "--training.global_batch_size", "16")
    assert "leave parallelism.data_parallel_shard_degree at -1" in refusal(
        2, "--training.global_batch_size", "16", "--parallelism.data_parallel_shard_degree", "2")
    assert "drop --data.streaming" in refusal(1, "--training.global_batch_size", "16", "--data.streaming")
    assert plan_layout(parse_args(["--training.global_batch_size", "32"]), 3, 4, dataset).first_slot == 3


# --- end to end: llama and flux -----------------------------------------------------------------------------

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


@pytest.mark.e2e
def test_uninterrupted_same_bits_at_1_2_4_processes(runs: Runs) -> None:
    for n in (2, 4):
        result = compare(runs.dumps["uninterrupted_1"], runs.dumps[f"uninterrupted_{n}"])
        assert result.returncode == 0, result.stdout
    assert sorted(read_loss_log(runs.dumps["uninterrupted_4"])) == list(range(1, STEPS + 1))


@pytest.mark.e2e
def test_4_process_checkpoint_resumed_at_2_and_at_1_same_bits(runs: Runs) -> None:
    for resumed in (runs.dumps["resumed_4_to_2"], runs.dumps["replay"]):
        _assert_continues(runs.dumps["uninterrupted_1"], resumed)


@pytest.mark.e2e
def test_replay_on_one_process_from_4_process_checkpoint(runs: Runs) -> None:
    _assert_continues(runs.dumps["uninterrupted_4"], runs.dumps["replay"])


@pytest.mark.e2e
def test_control_ordinary_data_parallelism_differs(runs: Runs, tmp_path: Path) -> None:
    """The comparison can fail: without the mode (per-rank streams, FSDP's reduction), 2 processes training
    the same global batch do not reproduce the invariant run's bits."""
    ordinary = tmp_path / "ordinary"
    train(ordinary, *[a for a in INVARIANT if a != "--parallelism.world_size_invariant"], nproc=2,
          config=runs.config)
    result = compare(runs.dumps["uninterrupted_1"], ordinary)
    assert result.returncode == 1
    assert result.stdout.startswith("first differing step 1:"), result.stdout


@pytest.mark.e2e
def test_one_process_checkpoint_resumes_at_4(runs: Runs, tmp_path: Path) -> None:
    """1 -> 4: a checkpoint of one process continues at four processes on the same bits."""
    _copy_checkpoint(runs.dumps["uninterrupted_1"], tmp_path)
    _run(tmp_path, runs.config, 4, *CHECKPOINTED)
    _assert_continues(runs.dumps["uninterrupted_4"], tmp_path)


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_launcher_refuses_a_process_count_that_does_not_split_the_step(tmp_path: Path) -> None:
    """Checked before torchrun starts any process: 2 processes cannot split 3 micro-batches."""
    proc = train(tmp_path, *INVARIANT, "--training.global_batch_size", "24", nproc=2, check=False)
    assert_refused(proc, "power-of-two number of processes that divides the 3 micro-batches")
    assert not (tmp_path / "loss_log.jsonl").exists()


@pytest.mark.e2e
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
