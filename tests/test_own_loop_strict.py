"""ExactResume keeps its promise or refuses: another process count is a CheckpointError on every rank (not a
silent inexact resume, not a KeyError on one rank), and an iterator made before load() is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import TensorDataset

from torchtitan_rng import CheckpointError, ExactResume, RestoreOrderError, build_dataloader

STEPS = 2


def _loop(folder: Path) -> ExactResume:
    """A tiny loop that saves at its last step; returns its ExactResume (loaded or fresh)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = build_dataloader(TensorDataset(torch.arange(32.0).view(16, 2)), batch_size=2, seed=0)
    return ExactResume(folder, model=model, optimizer=optimizer, dataloader=loader, interval=STEPS, seed=0)


def _train(exact: ExactResume) -> None:
    assert exact.load() == 0
    batches = iter(exact.dataloader)
    exact.restore_rng()
    for step in range(1, STEPS + 1):
        (inputs,) = next(batches)
        exact.manager.parts["model"].model(inputs).sum().backward()
        exact.maybe_save(step, last_step=STEPS)


def _in_group(rank: int, world: int, folder: Path, action: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/store_{action}", rank=rank, world_size=world)
    exact = _loop(folder / "checkpoint")
    if action == "save":
        _train(exact)
        assert _loop(folder / "checkpoint").load() == STEPS  # the control: the same process count loads
    else:
        with pytest.raises(CheckpointError, match=r"saved by 1 processes and this run has 2: .*run with 1 processes"):
            exact.load()
    dist.destroy_process_group()


@pytest.mark.e2e  # starts processes
def test_two_processes_refuse_a_one_process_checkpoint(tmp_path: Path) -> None:
    _train(_loop(tmp_path / "checkpoint"))
    mp.spawn(_in_group, args=(2, tmp_path, "refuse"), nprocs=2, join=True)


@pytest.mark.e2e  # starts processes
def test_one_process_refuses_a_two_process_checkpoint(tmp_path: Path) -> None:
    mp.spawn(_in_group, args=(2, tmp_path, "save"), nprocs=2, join=True)  # and, the control, 2 -> 2 loads
    with pytest.raises(CheckpointError, match=r"saved by 2 processes and this run has 1: .*run with 2 processes"):
        _loop(tmp_path / "checkpoint").load()


def test_iter_before_load_is_refused(tmp_path: Path) -> None:
    exact = _loop(tmp_path / "checkpoint")
    with pytest.raises(RestoreOrderError, match=r"iter\(dataloader\) was called before ExactResume.load\(\)"):
        iter(exact.dataloader)
    exact.load()
    next(iter(exact.dataloader))  # in order: accepted


def test_errors_name_parameters_not_trainer_flags(tmp_path: Path) -> None:
    _train(_loop(tmp_path / "checkpoint"))
    with pytest.raises(CheckpointError) as refused:
        _loop(tmp_path / "checkpoint").load(load_step=7)
    assert "load_step=7 not found" in str(refused.value) and "--checkpoint" not in str(refused.value)


def test_a_save_over_a_checkpoint_of_an_earlier_history_is_refused(tmp_path: Path) -> None:
    """Resumed from step 1 of a folder that holds step 2: saving step 2 again would replace a checkpoint
    this run did not write, so it is a one-line CheckpointError and step 2 stays as it was."""
    exact = _loop(tmp_path / "checkpoint")
    _train(exact)  # saves step 2
    exact.save(1)  # an older checkpoint in the same folder
    saved = {path.name: path.read_bytes() for path in (tmp_path / "checkpoint" / "step-2").iterdir()}
    again = _loop(tmp_path / "checkpoint")
    assert again.load(load_step=1) == 1
    with pytest.raises(CheckpointError, match=r"would save over the existing checkpoints 2 in .*initial_load_path="):
        again.maybe_save(2, last_step=STEPS)
    assert {path.name: path.read_bytes() for path in (tmp_path / "checkpoint" / "step-2").iterdir()} == saved
    # Control: from the same checkpoint into a fresh folder, the same save goes through.
    fresh = _loop(tmp_path / "fresh")
    assert fresh.load(initial_load_path=tmp_path / "checkpoint", load_step=1) == 1
    assert fresh.maybe_save(2, last_step=STEPS) == tmp_path / "fresh" / "step-2"
