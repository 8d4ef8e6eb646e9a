"""Train specs: what a model name in the config (``model.name``) builds.

A spec bundles the model, its dataset, its loss and how to shard it. The built-in specs are ``llama`` and
``flux``; ``job.custom_module`` may import a user module that calls :func:`register_train_spec`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import Dataset

from torchtitan_rng.config import ConfigError, JobConfig

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class TrainSpec:
    name: str
    # Called with the shared model-init seed set: must give identical weights on every rank.
    build_model: Callable[[JobConfig], nn.Module]
    # Map-style dataset; ``dataset[key]`` takes a sample key (see data/sampler.py) and returns a Batch
    # of one sample; ``len(dataset)`` is the number of distinct samples in an epoch.
    build_dataset: Callable[[JobConfig], Dataset]
    # The training loss for a batch already on the device; may draw from the global streams.
    loss_fn: Callable[[nn.Module, Batch, JobConfig], torch.Tensor]
    # Shards the model over the data-parallel mesh (FSDP2); called only with several processes.
    apply_fsdp: Callable[[nn.Module, Any], None]
    # Items a sample counts for throughput, and their unit ("tokens" or "images").
    items_per_sample: Callable[[JobConfig], int]
    throughput_unit: str
    # Optional validation pass: (model, config, step, dump_folder, device) -> metrics to log.
    validate: Callable[[nn.Module, JobConfig, int, Path, torch.device], dict[str, float]] | None = None


_specs: dict[str, TrainSpec] = {}


def register_train_spec(spec: TrainSpec) -> None:
    _specs[spec.name] = spec


def get_train_spec(config: JobConfig) -> TrainSpec:
    """The spec for ``model.name``, importing ``job.custom_module`` first if one is given."""
    import torchtitan_rng.models  # noqa: F401  (registers the built-in specs)

    if config.job.custom_module:
        try:
            importlib.import_module(config.job.custom_module)
        except Exception as err:  # any import failure is a user error here, reported in one line
            raise ConfigError(
                f"job.custom_module {config.job.custom_module!r} failed to import: "
                f"{type(err).__name__}: {err}"
            ) from None
    if config.model.name not in _specs:
        raise ConfigError(
            f"unknown model.name {config.model.name!r}; registered: {', '.join(sorted(_specs))}"
            " (a custom model needs job.custom_module to register it)"
        )
    return _specs[config.model.name]
