"""ExactResume on another process count: a CheckpointError on every rank (not a silent inexact resume, not a
KeyError on one rank); real gloo process groups."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.ranks import end_rank
from tests.support.tiny_loop import STEPS, tiny_loop, train_tiny_loop
from torchtitan_rng import CheckpointError


def _in_group(rank: int, world: int, folder: Path, action: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/store_{action}", rank=rank, world_size=world)
    exact = tiny_loop(folder / "checkpoint")
    if action == "save":
        train_tiny_loop(exact)
        assert tiny_loop(folder / "checkpoint").load() == STEPS  # the control: the same process count loads
    else:
        with pytest.raises(CheckpointError, match=r"saved by 1 processes and this run has 2: .*run with 1 processes"):
            exact.load()
    end_rank()


def test_two_processes_refuse_a_one_process_checkpoint(tmp_path: Path) -> None:
    train_tiny_loop(tiny_loop(tmp_path / "checkpoint"))
    mp.spawn(_in_group, args=(2, tmp_path, "refuse"), nprocs=2, join=True)


def test_one_process_refuses_a_two_process_checkpoint(tmp_path: Path) -> None:
    mp.spawn(_in_group, args=(2, tmp_path, "save"), nprocs=2, join=True)  # and, the control, 2 -> 2 loads
    with pytest.raises(CheckpointError, match=r"saved by 2 processes and this run has 1: .*run with 2 processes"):
        tiny_loop(tmp_path / "checkpoint").load()
