"""World-size-invariant training, its pieces: the global sampler, the slot-order sum and the grad norm (on real
gloo processes), the constraints on the layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils.data import Dataset

from tests.support.checks import float_bits
from tests.support.ranks import end_rank

from torchtitan_rng.config import ConfigError, parse_args
from torchtitan_rng.data.global_sampler import GlobalBatchSampler
from torchtitan_rng.parallel.invariant.reduction import SlotOrderExchange, grad_norm
from torchtitan_rng.parallel.invariant.setup import plan_slots
from torchtitan_rng.parallel.invariant.step import Slots
from torchtitan_rng.models.llama.spec import build_text_dataset


def test_global_sampler_places_micro_batches_by_global_position() -> None:
    """Slot j of step t holds the same keys whatever the process count; rank r takes slots r, r + world, ..."""
    def slots(world: int) -> list[list[int]]:
        samplers = [GlobalBatchSampler(20, 3, 12, rank, world, seed=7) for rank in range(world)]
        # Step by step, round by round, rank by rank: slot order.
        return [next(s) for _ in range(5) for _ in range(12 // world) for s in samplers]

    single = slots(1)
    assert slots(2) == single and slots(3) == single and slots(4) == single
    assert len({key for batch in single for key in batch}) > 20  # crosses epochs: keys carry the epoch
    resumed = GlobalBatchSampler(20, 3, 12, 1, 2, seed=7)
    resumed.load_state_dict({"step": 3, "slot": 0})
    assert next(resumed) == single[3 * 12 + 1]  # step 3: rank 1 of 2 starts at slot 1
    assert GlobalBatchSampler(20, 3, 12, 0, 1, seed=8).keys_of(0, 0) != single[0]  # control: another seed


MICRO_BATCHES = 6


def _gradients() -> torch.Tensor:
    """One flat "gradient" per micro-batch, magnitudes over six decades (so that the order of a sum shows)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(MICRO_BATCHES, 3 * 4096, generator=generator) * torch.logspace(-3, 3, 3 * 4096)


def _norm_grads() -> list[torch.Tensor]:
    """Gradients whose rows do not split evenly over 3 processes (10 rows: 4, 4, 2), and a vector."""
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(10, 700, generator=generator) * torch.logspace(-3, 3, 700), torch.randn(5, generator=generator)]


def _sum_worker(rank: int, world: int, store: str, out: str) -> None:
    """Rank ``rank`` runs slots rank, rank + world, ...: their gradients summed by the slot-order exchange; and
    the control, each rank's own sum then one all-reduce. Then the grad norm of DTensor-sharded gradients."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    gradients = _gradients()
    exchange = SlotOrderExchange()
    exchange.begin_step()
    for slot in range(rank, MICRO_BATCHES, world):
        gradient = exchange.allocate(gradients[slot].shape, dtype=torch.float32, device=torch.device("cpu"))
        gradient.copy_(gradients[slot])
        shard = exchange.allocate((gradients.shape[1] // world,), dtype=torch.float32, device=torch.device("cpu"))
        exchange(shard, gradient, dist.group.WORLD)
    plain = gradients[rank::world].sum(0)
    dist.all_reduce(plain)
    mesh = init_device_mesh("cpu", (world,))
    params = []
    for grad in _norm_grads():
        param = torch.nn.Parameter(distribute_tensor(torch.zeros_like(grad), mesh, [Shard(0)]))
        param.grad = distribute_tensor(grad, mesh, [Shard(0)])
        params.append(param)
    squares = sum(p.grad.to_local().square().sum() for p in params)
    dist.all_reduce(squares)  # the control: each rank's sum of squares, then one all-reduce
    torch.save({"exchange": exchange.shard, "plain": plain, "norm": grad_norm(params),
                "plain_norm": squares.sqrt()}, f"{out}.{rank}")
    end_rank()


def test_slot_order_sum_and_norm_same_bits_on_3_processes_as_on_one_plain_all_reduce_differs(tmp_path: Path) -> None:
    gradients = _gradients()
    one_process = gradients[0].clone()
    for slot in range(1, MICRO_BATCHES):
        one_process += gradients[slot]  # autograd's accumulation: the first assigned, each next added
    params = []
    for grad in _norm_grads():
        params.append(torch.nn.Parameter(torch.zeros_like(grad)))
        params[-1].grad = grad
    one_process_norm = grad_norm(params)
    plain_norm = sum(p.grad.square().sum() for p in params).sqrt()
    mp.spawn(_sum_worker, args=(3, str(tmp_path / "store"), str(tmp_path / "sum")), nprocs=3)
    results = [torch.load(tmp_path / f"sum.{rank}") for rank in range(3)]
    shards = torch.cat([r["exchange"] for r in results])
    assert torch.equal(shards.view(torch.int32), one_process.view(torch.int32))
    assert all(float_bits(r["norm"].item()) == float_bits(one_process_norm.item()) for r in results)
    # The controls: the same sums with each rank's partial sum all-reduced differ.
    assert not torch.equal(results[0]["plain"].view(torch.int32), one_process.view(torch.int32))
    assert float_bits(results[0]["plain_norm"].item()) != float_bits(plain_norm.item())


def _plan_slots(args: list[str], rank: int, world: int, dataset: Dataset) -> Slots:
    config = parse_args(args)
    return plan_slots(config.training, config.data, rank, world, dataset)


def test_constraints_are_one_line_config_errors() -> None:
    dataset = build_text_dataset(parse_args([]))

    def refusal(world: int, *args: str) -> str:
        with pytest.raises(ConfigError) as err:
            _plan_slots(["--parallelism.world_size_invariant", *args], 0, world, dataset)
        assert "\n" not in str(err.value)
        return str(err.value)

    assert "needs training.global_batch_size" in refusal(1)
    assert "not a multiple of training.local_batch_size" in refusal(1, "--training.global_batch_size", "20")
    assert "divides the 2 micro-batches per step (global / local batch size); got 4 processes: use 1, 2," in refusal(
        4, "--training.global_batch_size", "16")
    assert "got 4 processes: use 1, 2, 3, 6," in refusal(4, "--training.global_batch_size", "48")
    _plan_slots(["--parallelism.world_size_invariant", "--training.global_batch_size", "48"], 2, 3,
                dataset)  # 3 processes split 6 micro-batches
    assert "drop --data.streaming" in refusal(1, "--training.global_batch_size", "16", "--data.streaming")
    assert _plan_slots(["--training.global_batch_size", "32"], 3, 4, dataset).first_slot == 3
