"""World-size-invariant training, its pieces: the global sampler, the canonical sum (on real gloo processes),
the constraints on the layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchtitan_rng.config import ConfigError, parse_args
from torchtitan_rng.data.global_sampler import GlobalBatchSampler
from torchtitan_rng.parallel.invariant.reduction import butterfly_sum, tree_sum
from torchtitan_rng.parallel.invariant.setup import plan_layout
from torchtitan_rng.models.llama.spec import build_text_dataset


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
