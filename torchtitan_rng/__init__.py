"""torchtitan_rng: training runs that resume exactly, bit for bit.

The names below are the public API (reference: docs/api.md). ``import torchtitan_rng`` is cheap and has
no side effects: each name imports its module (and torch) the first time it is used.

Exact resume in your own loop: :class:`ExactResume`, :func:`build_dataloader`, :class:`RestoreOrderError`.
The pieces they bundle: :class:`TrainState`, :class:`CheckpointManager`, :func:`checkpoint_parts` and friends,
:class:`ResumableDataLoader`, per-sample generators (:class:`SampleRandomDataset`), the stream helpers of
``rng``. Your own model and dataset in
``run_train.sh``: :class:`TrainSpec` and :func:`register_train_spec`, imported via ``job.custom_module``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    # Exact resume in your own loop.
    "ExactResume": "torchtitan_rng.own_loop",
    "RestoreOrderError": "torchtitan_rng.own_loop",
    "build_dataloader": "torchtitan_rng.own_loop",
    # Step and per-rank random streams as a DCP Stateful.
    "TrainState": "torchtitan_rng.checkpoint.train_state",
    # Checkpoints on torch.distributed.checkpoint.
    "CheckpointManager": "torchtitan_rng.checkpoint.manager",
    "ModelState": "torchtitan_rng.checkpoint.states",
    "OptimizerState": "torchtitan_rng.checkpoint.states",
    "checkpoint_parts": "torchtitan_rng.checkpoint.states",
    "SafeLoadPlanner": "torchtitan_rng.checkpoint.safe_load",
    "complete_steps": "torchtitan_rng.checkpoint.layout",
    "resolve_checkpoint": "torchtitan_rng.checkpoint.layout",
    # Data.
    "ResumableDataLoader": "torchtitan_rng.data.dataloader",
    "split_sample_key": "torchtitan_rng.data.sampler",
    "SampleRandomDataset": "torchtitan_rng.data.sample_rng",
    "sample_generator": "torchtitan_rng.data.sample_rng",
    "sample_numpy_generator": "torchtitan_rng.data.sample_rng",
    "WorkerRNGDataset": "torchtitan_rng.data.worker_rng",
    # Random streams.
    "derive_seed": "torchtitan_rng.rng",
    "derived_generator": "torchtitan_rng.rng",
    "derived_numpy_generator": "torchtitan_rng.rng",
    "register_generator": "torchtitan_rng.rng",
    "capture_global_rng": "torchtitan_rng.rng",
    "restore_global_rng": "torchtitan_rng.rng",
    "preserved_global_rng": "torchtitan_rng.rng",
    "seed_training_streams": "torchtitan_rng.rng",
    # Plug-in models and datasets for run_train.sh.
    "TrainSpec": "torchtitan_rng.train_spec",
    "register_train_spec": "torchtitan_rng.train_spec",
    "JobConfig": "torchtitan_rng.config",
    # Every error a user sees derives from TorchtitanRngError (one line: what is wrong, what to do).
    "TorchtitanRngError": "torchtitan_rng.errors",
    "ConfigError": "torchtitan_rng.errors",
    "CheckpointError": "torchtitan_rng.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'torchtitan_rng' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # the same names, for type checkers and editors (tests check both lists agree)
    from torchtitan_rng.checkpoint.layout import complete_steps, resolve_checkpoint
    from torchtitan_rng.checkpoint.manager import CheckpointManager
    from torchtitan_rng.checkpoint.safe_load import SafeLoadPlanner
    from torchtitan_rng.checkpoint.states import ModelState, OptimizerState, checkpoint_parts
    from torchtitan_rng.config import JobConfig
    from torchtitan_rng.data.dataloader import ResumableDataLoader
    from torchtitan_rng.errors import CheckpointError, ConfigError, TorchtitanRngError
    from torchtitan_rng.data.sample_rng import SampleRandomDataset, sample_generator, sample_numpy_generator
    from torchtitan_rng.data.sampler import split_sample_key
    from torchtitan_rng.data.worker_rng import WorkerRNGDataset
    from torchtitan_rng.own_loop import ExactResume, RestoreOrderError, build_dataloader
    from torchtitan_rng.rng import (
        capture_global_rng,
        derive_seed,
        derived_generator,
        derived_numpy_generator,
        preserved_global_rng,
        register_generator,
        restore_global_rng,
        seed_training_streams,
    )
    from torchtitan_rng.train_spec import TrainSpec, register_train_spec
    from torchtitan_rng.checkpoint.train_state import TrainState
