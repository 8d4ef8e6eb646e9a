"""ExactResume keeps its promise or refuses, in one process: an iterator made before load() is refused, and
so is a save over a checkpoint of an earlier history. (Another process count: tests/e2e/test_own_loop_strict.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiny_loop import STEPS, tiny_loop, train_tiny_loop
from torchtitan_rng import CheckpointError, RestoreOrderError


def test_iter_before_load_is_refused(tmp_path: Path) -> None:
    exact = tiny_loop(tmp_path / "checkpoint")
    with pytest.raises(RestoreOrderError, match=r"iter\(dataloader\) was called before ExactResume.load\(\)"):
        iter(exact.dataloader)
    exact.load()
    next(iter(exact.dataloader))  # in order: accepted


def test_errors_name_parameters_not_trainer_flags(tmp_path: Path) -> None:
    train_tiny_loop(tiny_loop(tmp_path / "checkpoint"))
    with pytest.raises(CheckpointError) as refused:
        tiny_loop(tmp_path / "checkpoint").load(load_step=7)
    assert "load_step=7 not found" in str(refused.value) and "--checkpoint" not in str(refused.value)


def test_a_save_over_a_checkpoint_of_an_earlier_history_is_refused(tmp_path: Path) -> None:
    """Resumed from step 1 of a folder that holds step 2: saving step 2 again would replace a checkpoint
    this run did not write, so it is a one-line CheckpointError and step 2 stays as it was."""
    exact = tiny_loop(tmp_path / "checkpoint")
    train_tiny_loop(exact)  # saves step 2
    exact.save(1)  # an older checkpoint in the same folder
    saved = {path.name: path.read_bytes() for path in (tmp_path / "checkpoint" / "step-2").iterdir()}
    again = tiny_loop(tmp_path / "checkpoint")
    assert again.load(load_step=1) == 1
    with pytest.raises(CheckpointError, match=r"would save over the existing checkpoints 2 in .*initial_load_path="):
        again.maybe_save(2, last_step=STEPS)
    assert {path.name: path.read_bytes() for path in (tmp_path / "checkpoint" / "step-2").iterdir()} == saved
    # Control: from the same checkpoint into a fresh folder, the same save goes through.
    fresh = tiny_loop(tmp_path / "fresh")
    assert fresh.load(initial_load_path=tmp_path / "checkpoint", load_step=1) == 1
    assert fresh.maybe_save(2, last_step=STEPS) == tmp_path / "fresh" / "step-2"
