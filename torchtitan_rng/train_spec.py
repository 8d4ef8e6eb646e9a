"""Train specs: what a model name in the config (``model.name``) builds.

A spec bundles the model, its dataset, its loss and how to shard it. The built-in specs are ``llama`` and
``flux``; ``job.custom_module`` may import a user module that calls :func:`register_train_spec`.
"""

from __future__ import annotations

import importlib
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.data import Dataset

from torchtitan_rng.config import ConfigError, JobConfig

Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch, JobConfig], torch.Tensor]


@dataclass(frozen=True)
class TrainSpec:
    """What ``model.name = NAME`` trains: model, dataset, loss and sharding, registered under ``name``."""

    name: str
    # Called with the shared model-init seed set: must give identical weights on every rank.
    build_model: Callable[[JobConfig], nn.Module]
    # Map-style dataset; ``dataset[key]`` takes a sample key (see data/sampler.py) and returns a Batch
    # of one sample; ``len(dataset)`` is the number of distinct samples in an epoch.
    build_dataset: Callable[[JobConfig], Dataset]
    # The training loss for a batch already on the device; may draw from the global streams.
    loss_fn: LossFn
    # Shards the model over the data-parallel mesh (FSDP2) with the given MixedPrecisionPolicy; called only
    # with several processes.
    apply_fsdp: Callable[[nn.Module, Any, MixedPrecisionPolicy], None]
    # Items a sample counts for throughput, and their unit ("tokens" or "images").
    items_per_sample: Callable[[JobConfig], int]
    throughput_unit: str
    # Optional validation pass: (model, config, step, dump_folder, device) -> metrics to log.
    validate: Callable[[nn.Module, JobConfig, int, Path, torch.device], dict[str, float]] | None = None
    # The lists of repeated blocks (transformer layers) that activation checkpointing and compile wrap, and
    # that apply_fsdp shards one by one; None: the model has none (those options are then refused).
    block_lists: Callable[[nn.Module], list[nn.ModuleList]] | None = None


_specs: dict[str, TrainSpec] = {}


def register_train_spec(spec: TrainSpec) -> None:
    """Make ``spec`` available as ``model.name = spec.name`` (a later spec of the same name replaces it)."""
    _specs[spec.name] = spec


def _registered_names() -> str:
    return ", ".join(sorted(_specs)) or "none"


def _import_custom_module(name: str) -> None:
    """Import ``job.custom_module``; any failure is a user error reported in one line."""
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and (name == err.name or name.startswith(err.name + ".")):
            raise ConfigError(
                f"job.custom_module {name!r} not found: no module {err.name!r} on the Python path (put the "
                f"folder that holds it on PYTHONPATH); registered model names: {_registered_names()}"
            ) from None
        raise ConfigError(f"job.custom_module {name!r} failed to import: {_one_line(err)}") from None
    except Exception as err:  # whatever the user's module raises
        raise ConfigError(f"job.custom_module {name!r} failed to import: {_one_line(err)}") from None


def _one_line(err: BaseException) -> str:
    """``Type: first line of the message (file:line where it was raised)``."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    # The innermost frame in a real file (importlib's own frames are "<frozen ...>"); a SyntaxError's
    # message already names its file and line.
    frames = [frame for frame in traceback.extract_tb(err.__traceback__) if not frame.filename.startswith("<")]
    if not frames or isinstance(err, SyntaxError):
        return f"{type(err).__name__}: {message}"
    return f"{type(err).__name__}: {message} ({Path(frames[-1].filename).name}:{frames[-1].lineno})"


def get_train_spec(config: JobConfig) -> TrainSpec:
    """The spec for ``model.name``, importing ``job.custom_module`` first if one is given."""
    import torchtitan_rng.models  # noqa: F401  (registers the built-in specs)

    if config.job.custom_module:
        _import_custom_module(config.job.custom_module)
    if config.model.name not in _specs:
        hint = (f"job.custom_module {config.job.custom_module!r} did not register it" if config.job.custom_module
                else "a custom model needs job.custom_module to register it")
        raise ConfigError(
            f"unknown model.name {config.model.name!r}; registered: {_registered_names()} ({hint})"
        )
    return _specs[config.model.name]
