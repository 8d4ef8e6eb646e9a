"""Two gloo processes seeded differently: each gets exactly its own RNG state back through DCP."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from tests.support.ranks import end_rank

from torchtitan_rng.checkpoint.safe_load import SafeLoadPlanner
from torchtitan_rng.checkpoint.train_state import TrainState


WORLD = 2


def _init(rank: int, store: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)


def _own_state_comes_back(rank: int, folder: Path) -> None:
    _init(rank, folder / "store")
    torch.manual_seed(1000 + rank)
    torch.rand(rank + 1)  # a different position in the stream as well
    saved = TrainState(torch.device("cpu"), rank, WORLD)
    saved.step = 7
    expected = torch.get_rng_state()
    dcp.save({"train_state": saved}, checkpoint_id=str(folder / "ckpt"))

    torch.manual_seed(5)  # start-up randomness of a fresh process
    loaded = TrainState(torch.device("cpu"), rank, WORLD)
    dcp.load({"train_state": loaded}, checkpoint_id=str(folder / "ckpt"), planner=SafeLoadPlanner())
    assert loaded.step == 7
    assert loaded.restore_rng()
    assert torch.equal(torch.get_rng_state(), expected), f"rank {rank} did not get its own CPU RNG state back"
    states = [torch.empty_like(expected) for _ in range(WORLD)]
    dist.all_gather(states, torch.get_rng_state())
    assert not torch.equal(states[0], states[1]), "the two ranks were meant to hold different states"
    end_rank()


def _shared_key_loses_rank_state(rank: int, folder: Path) -> None:
    """Control (docs/design.md, "Per-rank values need rank-unique keys"): the same save under one shared key hands rank 1 rank 0's state."""
    _init(rank, folder / "store_shared")
    torch.manual_seed(1000 + rank)
    own = torch.get_rng_state()
    dcp.save({"rng": own}, checkpoint_id=str(folder / "shared"))
    template = {"rng": torch.zeros_like(own)}
    dcp.load(template, checkpoint_id=str(folder / "shared"))
    came_back = torch.equal(template["rng"], own)
    flags = [None] * WORLD
    dist.all_gather_object(flags, came_back)
    assert flags.count(False) >= 1, "expected DCP to keep only one rank's copy of a shared key"
    end_rank()


def test_each_rank_gets_its_own_rng_back(tmp_path: Path) -> None:
    mp.spawn(_own_state_comes_back, args=(tmp_path,), nprocs=WORLD, join=True)


def test_control_shared_key_gives_one_ranks_state_to_all(tmp_path: Path) -> None:
    mp.spawn(_shared_key_loses_rank_state, args=(tmp_path,), nprocs=WORLD, join=True)
