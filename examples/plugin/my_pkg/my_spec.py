"""A model, dataset and loss of your own, trained by run_train.sh under ``model.name = "noisy_sine"``.

Put the folder holding ``my_pkg`` on PYTHONPATH and name this module in the config::

    [job]
    custom_module = "my_pkg.my_spec"
    [model]
    name = "noisy_sine"

    PYTHONPATH=examples/plugin CONFIG_FILE=examples/plugin/noisy_sine.toml ./run_train.sh

run_train.sh imports the module before it looks the name up; everything else (checkpoints, the loss log,
exact resume, several processes) comes from the trainer.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import Dataset

from torchtitan_rng import ConfigError, JobConfig, SampleRandomDataset, TrainSpec, register_train_spec
from torchtitan_rng.config import Training

WIDTHS = {"small": 32, "wide": 128}  # model.flavor -> hidden width


class SineMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(1, width), nn.Linear(width, width), nn.Linear(width, 1)])
        self.dropout = nn.Dropout(0.1)  # draws from the global stream the trainer saves and restores

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = self.dropout(F.gelu(layer(x)))
        return self.layers[-1](x)


class NoisySine(SampleRandomDataset):
    """Points of sin(x) on [-pi, pi], with random jitter on x and noise on y, drawn per sample.

    The trainer hands ``__getitem__`` a sample key (epoch * len + index): the randomness comes from the
    sample's own stream, so it differs between epochs and is the same after a resume, with any number of
    workers (being a SampleRandomDataset, it may even resume with another ``data.num_workers``).
    """

    def __init__(self, num_samples: int, seed: int) -> None:
        super().__init__(seed, "noisy-sine")
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, key: int) -> dict[str, torch.Tensor]:
        _, index = self.epoch_and_index(key)
        noise = torch.randn(2, generator=self.sample_generator(key))
        x = -math.pi + 2 * math.pi * (index + 0.5) / self.num_samples + 0.05 * noise[0]
        return {"x": x.reshape(1), "y": (torch.sin(x) + 0.1 * noise[1]).reshape(1)}


def build_model(config: JobConfig) -> nn.Module:
    if config.model.flavor not in WIDTHS:
        raise ConfigError(f"unknown noisy_sine flavor {config.model.flavor!r}; choose one of: {', '.join(WIDTHS)}")
    return SineMLP(WIDTHS[config.model.flavor])


def build_dataset(config: JobConfig) -> Dataset:
    return NoisySine(config.data.num_samples or 256, config.debug.seed)


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor], training: Training) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]), batch["y"])


def apply_fsdp(model: nn.Module, mesh: object, mp_policy: MixedPrecisionPolicy) -> None:
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


register_train_spec(
    TrainSpec(
        name="noisy_sine",
        build_model=build_model,
        build_dataset=build_dataset,
        loss_fn=loss_fn,
        apply_fsdp=apply_fsdp,
        items_per_sample=lambda config: 1,
        throughput_unit="samples",
    )
)
