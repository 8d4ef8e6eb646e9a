"""ExactResume's order, load(), iter(dataloader), restore_rng(), in process: every misordering it can see raises
RestoreOrderError in one line, where before two of them went on silently inexact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import torchtitan_rng
from torchtitan_rng.own_loop import RestoreOrderError


class Noise(torch.utils.data.Dataset):
    """Draws from the global torch RNG in __getitem__: the order decides which stream a batch sees."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> torch.Tensor:
        return index + torch.rand(())


def _build(folder: Path) -> tuple[torchtitan_rng.ExactResume, torchtitan_rng.ResumableDataLoader]:
    loader = torchtitan_rng.build_dataloader(Noise(), batch_size=3, seed=5)
    return torchtitan_rng.ExactResume(folder, model=nn.Linear(2, 2), dataloader=loader, interval=2, seed=5), loader


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A folder with the checkpoint of step 2 of a run that went in order."""
    exact, loader = _build(tmp_path)
    with exact:
        exact.load()
        batches = iter(loader)
        exact.restore_rng()
        next(batches), next(batches)
        exact.maybe_save(2, last_step=4)
    return tmp_path


def _one_line(err: pytest.ExceptionInfo[RestoreOrderError]) -> str:
    assert "\n" not in str(err.value)
    return str(err.value)


def test_restore_before_load_is_refused(saved: Path) -> None:
    exact, loader = _build(saved)
    with exact:
        with pytest.raises(RestoreOrderError, match=r"restore_rng\(\) was called before ExactResume.load\(\)") as err:
            exact.restore_rng()
        _one_line(err)
        # In order, the same objects go on (nothing was restored or seeded by the refused call).
        assert exact.load() == 2
        iter(loader)
        assert exact.restore_rng() is True


def test_load_again_after_batches_is_refused(saved: Path) -> None:
    """load(); iter; next; next; load(): the second load would reset the count the order check reads while the
    live iterator keeps its place."""
    exact, loader = _build(saved)
    with exact:
        assert exact.load() == 2
        batches = iter(loader)
        next(batches), next(batches)
        with pytest.raises(RestoreOrderError, match=r"load\(\) was called after iter\(dataloader\)") as err:
            exact.load()
        _one_line(err)
        with pytest.raises(RestoreOrderError, match="after the dataloader yielded 2 batch"):
            exact.restore_rng()  # the count was not reset by the refused load


def test_load_after_restore_is_refused(saved: Path) -> None:
    exact = torchtitan_rng.ExactResume(saved / "other", model=nn.Linear(2, 2), interval=2, seed=5)
    exact.load()
    exact.restore_rng()
    with pytest.raises(RestoreOrderError, match=r"load\(\) was called after restore_rng\(\)"):
        exact.load()


def test_the_order_itself_is_accepted(saved: Path) -> None:
    """Control: load() may be repeated before the run starts; the documented order resumes."""
    exact, loader = _build(saved)
    with exact:
        assert exact.load() == 2 and exact.load() == 2
        batches = iter(loader)
        assert exact.restore_rng() is True
        next(batches)
