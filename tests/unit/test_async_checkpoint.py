"""checkpoint.async_mode = "async" in one process: what is written is the state at save(), not at the write."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchtitan_rng.checkpoint.layout import complete_steps
from torchtitan_rng.checkpoint.manager import CheckpointManager
from torchtitan_rng.checkpoint.states import ModelState
from torchtitan_rng.checkpoint.train_state import TrainState


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no process group
def test_async_save_is_the_boundary_not_the_write(tmp_path: Path) -> None:
    """What is written is the state when save() returned, though the model and RNG move on right away."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)  # 4 MiB: the write is still going on when the loop continues
    before = model.weight.detach().clone()
    train_state = TrainState(torch.device("cpu"))
    train_state.step = 1
    rng_before = torch.get_rng_state()
    manager = CheckpointManager(tmp_path, {"model": ModelState(model), "train_state": train_state}, interval=1,
                                async_mode="async")
    manager.save(1)  # not the last step: async_mode writes it in the background
    assert complete_steps(tmp_path) == []  # never picked before the write has finished everywhere
    with torch.no_grad():
        model.weight.add_(1.0)  # the next optimizer step
    torch.rand(8)  # the next step's dropout
    manager.wait()
    assert complete_steps(tmp_path) == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]

    fresh_model = torch.nn.Linear(1024, 1024)
    fresh_state = TrainState(torch.device("cpu"))
    CheckpointManager(tmp_path, {"model": ModelState(fresh_model), "train_state": fresh_state}, interval=1).load(
        tmp_path / "step-1")
    assert torch.equal(fresh_model.weight, before)
    assert fresh_state.step == 1 and torch.equal(fresh_state.loaded["rng"]["torch_cpu"], rng_before)
