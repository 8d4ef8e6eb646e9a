"""The torchtitan plug-in carries each loader worker's streams (``carry_worker_streams``): a real
StatefulDataLoader with one worker process, over an iterable dataset that draws in ``__iter__`` as Flux's does
(its random crop and caption dropout), or a map-style one that draws in ``__getitem__``, stopped after 3
batches and resumed in a new loader, yields the batches the uninterrupted loader yields; without the carry
(the control) the resumed worker restarts its streams. The launches (Flux with ``--dataloader.num_workers 1``):
tests/e2e/test_torchtitan_plugin.py."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

pytest.importorskip("torchtitan")

BATCHES, STOP = 6, 3


class DrawingStream(IterableDataset):
    """Stateful like torchtitan's datasets (its position); every sample draws from the worker's torch stream."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            self.position += 1
            yield torch.tensor([float(self.position), torch.rand(1).item()])

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


class DrawingSamples(Dataset):
    """Map-style: every sample draws from the worker's torch stream in ``__getitem__``."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index + 1), torch.rand(1).item()])


def _loader(carry: bool | None, kind: type = DrawingStream) -> tuple[Any, str | None]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    from torchtitan_rng.integrations.torchtitan import carry_worker_streams

    loader = StatefulDataLoader(kind(), batch_size=2, num_workers=1)
    return loader, (None if carry is None else carry_worker_streams(loader, carry))


def _batches(loader: Any, count: int, state: dict[str, Any] | None = None) -> tuple[list[torch.Tensor], Any]:
    if state is not None:
        loader.load_state_dict(state)
    torch.manual_seed(0)  # as torchtitan seeds each process before its loader draws the workers' base seed
    iterator = iter(loader)
    batches = [next(iterator) for _ in range(count)]
    return batches, loader.state_dict()


def _stop_and_resume(carry: bool | None, kind: type) -> tuple[list[torch.Tensor], list[torch.Tensor], str | None]:
    full, _ = _batches(_loader(carry, kind)[0], BATCHES)
    first, state = _batches(_loader(carry, kind)[0], STOP)
    loader, line = _loader(carry, kind)
    rest, _ = _batches(loader, BATCHES - STOP, state)
    return full, first + rest, line


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


KINDS = pytest.mark.parametrize("kind", [DrawingStream, DrawingSamples], ids=["iterable", "map-style"])


@KINDS
def test_a_resumed_worker_continues_its_streams(kind: type) -> None:
    full, resumed, line = _stop_and_resume(True, kind)
    assert line is None
    assert _same(full, resumed)


@KINDS
def test_control_without_the_carry_the_resumed_worker_restarts_and_is_named(kind: type) -> None:
    full, resumed, line = _stop_and_resume(False, kind)
    assert line is not None and "runs 1 worker and worker_streams is off" in line and "not exact" in line
    assert _same(full[:STOP], resumed[:STOP])
    # The positions resume right (the dataset's own state), the draws do not.
    assert all(torch.equal(a[:, 0], b[:, 0]) for a, b in zip(full, resumed, strict=True))
    assert not torch.equal(full[STOP][:, 1], resumed[STOP][:, 1])


def test_checkpoints_read_the_same_with_and_without_the_wrapper() -> None:
    # A stock checkpoint (no worker streams) resumes with the wrapper: the dataset's own position continues.
    _, state = _batches(_loader(carry=None)[0], STOP)
    rest, _ = _batches(_loader(carry=True)[0], 1, state)
    assert rest[0][0, 0].item() == 2 * STOP + 1
    # The wrapper's checkpoint resumes without it: the dataset is handed its own keys.
    _, state = _batches(_loader(carry=True)[0], STOP)
    rest, _ = _batches(_loader(carry=None)[0], 1, state)
    assert rest[0][0, 0].item() == 2 * STOP + 1


def test_a_loader_without_workers_state_is_named_and_no_workers_needs_nothing() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    from torchtitan_rng.integrations.torchtitan import carry_worker_streams

    line = carry_worker_streams(DataLoader(DrawingStream(), batch_size=2, num_workers=2))
    assert line is not None and "runs 2 workers and the dataloader (DataLoader) is not a torchdata " \
                                "StatefulDataLoader" in line
    dataset = DrawingStream()
    loader = StatefulDataLoader(dataset, batch_size=2)
    assert carry_worker_streams(loader) is None and loader.dataset is dataset
