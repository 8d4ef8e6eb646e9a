"""ExactResume records what a loop was built with and refuses a resume that changed it, naming each key with
its saved and new value; ``allow_changes`` goes on with a WARNING and the values the loop was built with;
damaged files are refused at load; ``close()`` / ``with`` end the loader's workers, and so does dropping the
ExactResume without either."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from tests.support.checks import float_bits
from torchtitan_rng import CheckpointError, ExactResume, build_dataloader

LAST = 4  # saves at 2 and 4


def _build(folder: Path, *, lr: float = 0.1, width: int = 4, batch_size: int = 2, seed: int = 0,
           config: dict[str, Any] | None = None, num_workers: int = 0) -> tuple[ExactResume, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, width), nn.Dropout(0.5), nn.Linear(width, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loader = build_dataloader(TensorDataset(torch.randn(32, 2, generator=torch.Generator().manual_seed(1))),
                              batch_size=batch_size, seed=seed, num_workers=num_workers)
    exact = ExactResume(folder, model=model, optimizer=optimizer, dataloader=loader, interval=2, seed=seed,
                        config=config)
    return exact, model


def _train(exact: ExactResume, model: nn.Module, start: int) -> list[bytes]:
    """Steps ``start + 1`` to LAST; their losses as float bits."""
    losses = []
    with exact:
        batches = iter(exact.dataloader)
        exact.restore_rng()
        for step in range(start + 1, LAST + 1):
            (inputs,) = next(batches)
            loss = model(inputs).pow(2).mean()
            exact.optimizer.zero_grad()
            loss.backward()
            exact.optimizer.step()
            losses.append(float_bits(loss.item()))
            exact.maybe_save(step, last_step=LAST)
    return losses


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, list[bytes]]:
    """A run's checkpoint folder (saves at 2 and 4) and its losses."""
    exact, model = _build(tmp_path / "checkpoint", config={"data": "v1"})
    assert exact.load() == 0
    return tmp_path / "checkpoint", _train(exact, model, 0)


def test_unchanged_resume_is_quiet_and_exact(saved: tuple[Path, list[bytes]], capsys: pytest.CaptureFixture) -> None:
    folder, losses = saved
    exact, model = _build(folder.parent / "resumed", config={"data": "v1"})
    assert exact.load(initial_load_path=folder / "step-2") == 2
    assert _train(exact, model, 2) == losses[2:]
    assert "WARNING" not in capsys.readouterr().err


CHANGES = {  # the build's change -> what the refusal names
    "lr": ({"lr": 0.2}, "optimizer.group0.lr = 0.2 but checkpoint {ckpt} was trained with 0.1"),
    "shape": ({"width": 8}, "model.0.weight = [8, 2] but checkpoint {ckpt} was trained with [4, 2]"),
    "batch size": ({"batch_size": 4}, "dataloader.batch_size = 4 but checkpoint {ckpt} was trained with 2"),
    "seed": ({"seed": 1}, "dataloader.seed = 1 but checkpoint {ckpt} was trained with 0"),
    "user config": ({"config": {"data": "v2"}}, "config.data = 'v2' but checkpoint {ckpt} was trained with 'v1'"),
}


@pytest.mark.parametrize("case", CHANGES)
def test_a_changed_build_is_refused_naming_the_key(saved: tuple[Path, list[bytes]], case: str) -> None:
    folder, _ = saved
    kwargs, named = CHANGES[case]
    kwargs = {"config": {"data": "v1"}, **kwargs}
    exact, model = _build(folder, **kwargs)
    before = [param.detach().clone() for param in model.parameters()]
    with pytest.raises(CheckpointError) as refused:
        exact.load()
    message = str(refused.value)
    assert named.format(ckpt=folder / "step-4") in message, message
    assert re.search(r'pass allow_changes=\["[\w.]+"\] to continue with the new one', message), message
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing was loaded
    exact.close()


def test_every_changed_key_is_named(saved: tuple[Path, list[bytes]]) -> None:
    exact, _ = _build(saved[0], lr=0.2, batch_size=4, config={"data": "v1"})
    with pytest.raises(CheckpointError) as refused:
        exact.load()
    lines = str(refused.value).splitlines()
    assert [line.removeprefix("error: ").split(" = ")[0] for line in lines] == [
        "dataloader.batch_size", "optimizer.group0.lr"], lines


def test_allowed_change_warns_and_trains_with_the_new_value(saved: tuple[Path, list[bytes]],
                                                           capsys: pytest.CaptureFixture) -> None:
    folder, losses = saved
    exact, model = _build(folder.parent / "resumed", lr=0.2, config={"data": "v1"})
    assert exact.load(initial_load_path=folder / "step-2", allow_changes=["lr"]) == 2
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING: optimizer.group0.lr = 0.2 but checkpoint"), warnings
    assert warnings[0].endswith("allows optimizer.group0.lr: this run is no longer the one that was stopped")
    assert exact.optimizer.param_groups[0]["lr"] == 0.2  # the value built with, not the checkpoint's 0.1
    # The bit comparison catches the changed run at its first step (the control of the exact resume above).
    resumed = _train(exact, model, 2)
    assert resumed[0] == losses[2] and resumed[1] != losses[3]  # step 3's loss is taken before lr acts


def test_damaged_checkpoint_is_refused(saved: tuple[Path, list[bytes]]) -> None:
    folder, _ = saved
    shard = folder / "step-4" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    exact, _ = _build(folder, config={"data": "v1"})
    with pytest.raises(CheckpointError, match=r"step-4 is damaged: __0_0.distcp does not match the checksum"):
        exact.load()
    assert exact.load(load_step=2) == 2  # control: the undamaged checkpoint loads


def _workers(exact: ExactResume) -> list[Any]:
    return list(exact.dataloader._iterator._workers)


def test_close_and_with_end_the_workers(tmp_path: Path) -> None:
    exact, _ = _build(tmp_path / "checkpoint", num_workers=2)
    with exact:
        exact.load()
        next(iter(exact.dataloader))
        workers = _workers(exact)
        assert len(workers) == 2 and all(worker.is_alive() for worker in workers)
    assert not any(worker.is_alive() for worker in workers)
    exact.close()  # a second close does nothing


