"""build_dataloader: what a dataset receives, and the DataLoader arguments it accepts and forwards."""

from __future__ import annotations

import os
import pickle
import signal
from typing import Iterator

import pytest
import torch
from torch.utils.data import TensorDataset

import torchtitan_rng
from torchtitan_rng import signals


class KeyEcho(torchtitan_rng.SampleRandomDataset):
    def __init__(self) -> None:
        super().__init__(0, "echo")

    def __len__(self) -> int:
        return 10

    def __getitem__(self, key: int) -> int:
        return key


def test_loader_hands_indices_or_sample_keys() -> None:
    """A plain dataset gets indices in range(len) in every epoch; a SampleRandomDataset gets sample keys."""
    batches = iter(torchtitan_rng.build_dataloader(TensorDataset(torch.arange(10)), batch_size=5, seed=0))
    epochs = [torch.cat([next(batches)[0], next(batches)[0]]) for _ in range(3)]
    for seen in epochs:
        assert torch.equal(seen.sort().values, torch.arange(10))
    assert not torch.equal(epochs[0], epochs[1])  # a new permutation each epoch
    keys = iter(torchtitan_rng.build_dataloader(KeyEcho(), batch_size=5, seed=0))
    second_epoch = torch.cat([next(keys) for _ in range(4)][2:])
    assert torch.equal(second_epoch.sort().values, torch.arange(10, 20))


# --- What a DataLoader user passes -------------------------------------------------------------------------

class WorkerInfo(torch.utils.data.Dataset):
    """Sample ``index`` as (index, the worker's pid, what the user's worker_init_fn saw in that worker)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> tuple[int, int, str]:
        return index, os.getpid(), _seen_at_init


_seen_at_init = "no worker_init_fn ran"


def _user_worker_init(worker_id: int) -> None:
    global _seen_at_init
    ignored = signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    _seen_at_init = f"worker {worker_id}: SIGUSR2 {'ignored' if ignored else 'handled'}"


def _as_lists(batch: list[tuple[int, int, str]]) -> dict[str, list]:
    return {"index": [b[0] for b in batch], "pid": [b[1] for b in batch], "init": [b[2] for b in batch]}


def _loader(batch_size: int = 4, **options: object) -> torchtitan_rng.ResumableDataLoader:
    return torchtitan_rng.build_dataloader(WorkerInfo(), batch_size=batch_size, seed=3, num_workers=2,
                                           collate_fn=_as_lists, **options)


def test_collate_fn_shapes_the_batches_and_the_position_resumes() -> None:
    loader = _loader()
    batches = iter(loader)
    next(batches), next(batches)
    state = loader.state_dict()
    expected = [next(batches)["index"] for _ in range(3)]  # crosses the epoch boundary after batch 3
    del batches
    resumed = _loader()
    resumed.load_state_dict(state)
    batches = iter(resumed)
    assert [next(batches)["index"] for _ in range(3)] == expected
    del batches


@pytest.fixture
def rank_handles_sigusr2() -> Iterator[None]:
    """This process handles SIGUSR2 as a rank that checkpoints on it does (workers fork with the handler)."""
    signals.install(["SIGUSR2"])
    try:
        yield
    finally:
        signals.install([])


def test_user_worker_init_fn_runs_after_ours(rank_handles_sigusr2: None) -> None:
    batches = iter(_loader(worker_init_fn=_user_worker_init))
    seen = set(next(batches)["init"]) | set(next(batches)["init"])
    del batches
    # Ours ran first: the worker already ignored the rank's signal when the user's function looked.
    assert seen == {"worker 0: SIGUSR2 ignored", "worker 1: SIGUSR2 ignored"}
    # Control: a plain DataLoader's workers inherit the rank's handler, and the check sees it.
    plain = torch.utils.data.DataLoader(WorkerInfo(), batch_size=4, num_workers=2, collate_fn=_as_lists,
                                        worker_init_fn=_user_worker_init)
    batches = iter(plain)
    assert set(next(batches)["init"]) | set(next(batches)["init"]) == {"worker 0: SIGUSR2 handled",
                                                                         "worker 1: SIGUSR2 handled"}
    del batches


def test_persistent_workers_outlive_an_epoch_of_iter() -> None:
    def pids_of_two_iterations(loader: torchtitan_rng.ResumableDataLoader) -> list[set[int]]:
        seen = []
        for _ in range(2):
            batches = iter(loader)
            seen.append(set(next(batches)["pid"]) | set(next(batches)["pid"]))
            del batches
        return seen

    first, second = pids_of_two_iterations(_loader(persistent_workers=True))
    assert first == second and os.getpid() not in first
    first, second = pids_of_two_iterations(_loader())  # control: new workers for every iter()
    assert first.isdisjoint(second)


def test_pin_memory_timeout_and_multiprocessing_context_are_forwarded() -> None:
    loader = _loader(pin_memory=True, timeout=30.0, multiprocessing_context="spawn",
                     worker_init_fn=_user_worker_init)
    assert loader.pin_memory is True and loader.timeout == 30.0
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    # A spawned worker gets the worker_init_fn pickled (starting real spawned workers takes ~10 s here).
    assert pickle.loads(pickle.dumps(loader.worker_init_fn)).user_fn is _user_worker_init


def test_drop_last_false_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError) as refused:
        _loader(drop_last=False)
    assert "\n" not in str(refused.value) and "every batch is full" in str(refused.value)
    batches = iter(_loader(batch_size=5, drop_last=True))  # 12 samples: the third batch spans two epochs
    assert [len(next(batches)["index"]) for _ in range(3)] == [5, 5, 5]
    del batches


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(10))


def test_an_iterable_dataset_is_one_clear_error() -> None:
    for build in (lambda: torchtitan_rng.build_dataloader(Stream(), batch_size=2, seed=0),
                  lambda: torchtitan_rng.ResumableDataLoader(Stream(), batch_size=2, dp_rank=0, dp_world=1, seed=0)):
        with pytest.raises(TypeError) as refused:
            build()
        message = str(refused.value)
        assert "\n" not in message and "Stream" in message and "IterableDataset" in message, message
        assert "needs a map-style dataset" in message, message


def test_snapshots_follow_the_save_interval_unless_chosen(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A snapshot costs each worker a capture of its streams: by default only as often as ExactResume saves."""
    data = TensorDataset(torch.arange(10))
    default = torchtitan_rng.build_dataloader(data, batch_size=5, seed=0)
    chosen = torchtitan_rng.build_dataloader(data, batch_size=5, seed=0, snapshot_every_n_steps=3)
    assert default.snapshot_every_n_steps == 1  # alone, the loader snapshots every batch
    for name, loader in (("default", default), ("chosen", chosen)):
        torchtitan_rng.ExactResume(tmp_path / name, model=torch.nn.Linear(1, 1), dataloader=loader, interval=7)
    assert (default.snapshot_every_n_steps, chosen.snapshot_every_n_steps) == (7, 3)
