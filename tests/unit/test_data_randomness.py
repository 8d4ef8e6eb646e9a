"""Data-side randomness survives resume: random __getitem__, dataloader workers, prefetching, epochs.

This rebuilds the restore-order case (HF Trainer restoring the RNG after fetching the first resumed batch;
docs/design.md, "The restore point") with this project's pieces, in-process with real StatefulDataLoader
workers and real DCP checkpoints: a dataset adding random noise in ``__getitem__``, a model with dropout, a
checkpoint after step 3, a resume; every resumed step's output must equal the uninterrupted run's bit for
bit. Form 1 draws the noise from the sample's own
generator, form 2 from the global RNGs (which the worker-RNG capture carries across the resume).

The same through the trainers: test_trainer_data_randomness.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from torchtitan_rng.checkpoint.layout import step_dir
from torchtitan_rng.checkpoint.manager import CheckpointManager
from torchtitan_rng.checkpoint.states import checkpoint_parts
from torchtitan_rng.config import ConfigError
from torchtitan_rng.data.dataloader import ResumableDataLoader
from torchtitan_rng.data.sample_rng import SampleRandomDataset
from torchtitan_rng.data.worker_rng import with_worker_rng
from torchtitan_rng.rng import seed_model_init, seed_training_streams
from torchtitan_rng.checkpoint.train_state import TrainState

SEED = 42
STOP = 3  # the checkpoint is taken after step 3
TOTAL = 9  # 40 samples in batches of 10: epoch boundaries after steps 4 and 8
_g = torch.Generator().manual_seed(0)
BASE = TensorDataset(torch.randn(40, 10, generator=_g), torch.randn(40, 10, generator=_g))


class GlobalNoiseDataset(Dataset):
    """Form 2: a random transform drawing from torch's, NumPy's and Python's global RNGs."""

    def __len__(self) -> int:
        return len(BASE)

    def __getitem__(self, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        data, label = BASE[key % len(BASE)]  # the sampler hands out keys epoch * len + index
        noise = torch.rand(data.shape) * 0.001 + np.random.rand() * 0.001 + random.random() * 0.001
        return data + noise, label


class SampleNoiseDataset(SampleRandomDataset):
    """Form 1: the same kind of noise from the sample's own generators (torch and NumPy)."""

    def __init__(self) -> None:
        super().__init__(SEED, "noise")

    def __len__(self) -> int:
        return len(BASE)

    def __getitem__(self, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        _, index = self.epoch_and_index(key)
        data, label = BASE[index]
        noise = torch.rand(data.shape, generator=self.sample_generator(key)) * 0.001
        return data + noise + self.sample_numpy_generator(key).random() * 0.001, label


class SimpleModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(10, 10)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.linear(x))


Outputs = dict[int, tuple[torch.Tensor, torch.Tensor]]  # step -> (model output, labels of the batch)


def run_experiment(folder: Path, form: str, num_workers: int, *, resume: bool = False, capture: bool = True,
                   snapshot_every: int = 1, prefetch: int = 2, on_change: str = "error") -> Outputs:
    """Steps 1..TOTAL saving after STOP, or (``resume``) steps STOP+1..TOTAL from that checkpoint."""
    seed_model_init(SEED)
    model = SimpleModel().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = GlobalNoiseDataset() if form == "global" else SampleNoiseDataset()
    loader = ResumableDataLoader(
        with_worker_rng(dataset, capture), batch_size=10, dp_rank=0, dp_world=1, seed=SEED,
        num_workers=num_workers, prefetch_factor=prefetch, snapshot_every_n_steps=snapshot_every,
        on_num_workers_change=on_change,
    )
    train_state = TrainState(torch.device("cpu"))
    parts = checkpoint_parts(model=model, optimizer=optimizer, dataloader=loader, train_state=train_state)
    checkpointer = CheckpointManager(folder, parts, interval=STOP)
    if resume:
        checkpointer.load(step_dir(folder, STOP))
    batches = iter(loader)
    if not (resume and train_state.restore_rng()):  # the global streams last, as the trainer does
        seed_training_streams(SEED, 0)
    outputs: Outputs = {}
    for step in range(train_state.step + 1, TOTAL + 1):
        inputs, labels = next(batches)
        output = model(inputs)
        optimizer.zero_grad()
        output.square().mean().backward()
        optimizer.step()
        outputs[step] = (output.detach().clone(), labels)
        train_state.step = step
        if step == STOP and not resume:
            checkpointer.save(step)
    del batches  # shuts the workers down
    return outputs


def resumed_equals_uninterrupted(tmp_path: Path, form: str, num_workers: int, *, resume_workers: int | None = None,
                                 **options: object) -> list[bool]:
    """Per resumed step, whether its output equals the uninterrupted run's bit for bit."""
    uninterrupted = run_experiment(tmp_path, form, num_workers, **options)
    resumed = run_experiment(tmp_path, form, num_workers if resume_workers is None else resume_workers,
                             resume=True, **options)
    assert sorted(resumed) == list(range(STOP + 1, TOTAL + 1))
    return [torch.equal(uninterrupted[step][0], resumed[step][0]) for step in resumed]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("form", ["global", "sample"])
def test_restore_order_resumed_steps_equal_uninterrupted(tmp_path: Path, form: str, num_workers: int) -> None:
    assert all(resumed_equals_uninterrupted(tmp_path, form, num_workers))


@pytest.mark.parametrize(("form", "snapshot_every", "prefetch"),
                         [("global", 1, 4), ("global", 2, 2), ("global", 4, 1), ("sample", 2, 2)])
def test_prefetching_and_snapshot_interval(tmp_path: Path, form: str, snapshot_every: int, prefetch: int) -> None:
    """The checkpoint after step 3 falls between snapshots for intervals 2 and 4: torchdata resumes from the
    last snapshot and replays the batches since, in the restored workers, which keeps their streams exact."""
    assert all(resumed_equals_uninterrupted(tmp_path, form, 2, snapshot_every=snapshot_every, prefetch=prefetch))


def test_control_without_worker_rng_capture_differs(tmp_path: Path) -> None:
    """The comparison can fail: without the capture the resumed workers restart their global streams
    (docs/design.md, "Randomness inside dataloader workers"), so the same samples come with other noise."""
    uninterrupted = run_experiment(tmp_path, "global", 2, capture=False)
    resumed = run_experiment(tmp_path, "global", 2, resume=True, capture=False)
    assert torch.equal(uninterrupted[STOP + 1][1], resumed[STOP + 1][1])  # the sample order is right
    assert not torch.equal(uninterrupted[STOP + 1][0], resumed[STOP + 1][0])


def test_sample_randomness_does_not_depend_on_workers(tmp_path: Path) -> None:
    without = run_experiment(tmp_path / "w0", "sample", 0)
    with_workers = run_experiment(tmp_path / "w2", "sample", 2, prefetch=3)
    assert all(torch.equal(without[step][0], with_workers[step][0]) for step in without)


@pytest.mark.parametrize(("saved", "resumed"), [(2, 0), (0, 2), (2, 1)])
def test_sample_randomness_resumes_with_another_worker_count(tmp_path: Path, saved: int, resumed: int) -> None:
    # Snapshots every 2 steps: the checkpoint after step 3 is one batch past the last snapshot.
    assert all(resumed_equals_uninterrupted(tmp_path, "sample", saved, resume_workers=resumed, snapshot_every=2))


def test_global_randomness_refuses_another_worker_count(tmp_path: Path) -> None:
    run_experiment(tmp_path, "global", 2)
    with pytest.raises(ConfigError) as refused:
        run_experiment(tmp_path, "global", 0, resume=True)
    message = str(refused.value)
    assert "\n" not in message
    assert "ran 2 workers and this run has 0" in message and 'on_num_workers_change="warn"' in message


def test_global_randomness_with_warn_continues(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_experiment(tmp_path, "global", 2)
    resumed = run_experiment(tmp_path, "global", 1, resume=True, on_change="warn")
    assert sorted(resumed) == list(range(STOP + 1, TOTAL + 1))
    assert "WARNING: the checkpoint's dataloader ran 2 workers and this run has 1" in capsys.readouterr().err
