"""Train specs: what a model name in the config (``model.name``) builds.

A spec bundles the model, its dataset, its loss and how to shard it. The built-in specs are ``llama`` and
``flux`` (``torchtitan_rng/models``); ``job.custom_module`` may import a user module that calls
:func:`register_train_spec`. This module knows no model: ``torchtitan_rng.models.get_train_spec`` looks one up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.data import Dataset

from torchtitan_rng.config import JobConfig, Training

Batch = dict[str, torch.Tensor]
# (model, batch, the [training] section): the loss of one micro-batch.
LossFn = Callable[[nn.Module, Batch, Training], torch.Tensor]


@dataclass(frozen=True)
class PipelineSplit:
    """How a model splits into pipeline stages (``parallelism.pipeline_parallel_degree``): its repeated blocks
    are the first of ``TrainSpec.block_lists``; the first stage also holds what comes before them, the last what
    comes after. Parameter names stay those of the whole model, so a checkpoint keeps its keys."""

    # (model, the block indices this rank holds, holds the first stage, holds the last): drop the rest in place.
    prune: Callable[[nn.Module, set[int], bool, bool], None]
    # (model, one stage's block indices, first, last): that stage's module, sharing the model's submodules.
    stage: Callable[[nn.Module, list[int], bool, bool], nn.Module]
    # The last stage's output and the target: the loss, for the schedule's set-up call on uninitialised outputs.
    # A micro-batch's loss is ``TrainSpec.loss_fn``'s, given a model that returns the last stage's output.
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    input_key: str  # the batch entry the first stage takes
    target_key: str  # the batch entry the loss takes
    # (blocks needed): the overrides that give the model at least that many blocks ("": none does), for the advice
    # of a refusal of too many stages for the model.
    deeper: Callable[[int], str] | None = None


@dataclass(frozen=True)
class TensorParallelSplit:
    """How a model's layers split over the ranks of a tensor-parallel group
    (``parallelism.tensor_parallel_degree``), with torch's own styles (``parallelize_module``, DTensor)."""

    # (config, degree): why ``degree`` ranks cannot split this config's model, in one line; None: they can.
    # Called before any process starts (no model is built).
    check: Callable[[JobConfig, int], str | None]
    # (model or one pipeline stage's part of it, the tensor-parallel mesh): split it in place, before FSDP2. Every
    # parameter it leaves must be a DTensor on the mesh (replicated where not split), so that FSDP2 and the
    # gradient norm see one mesh.
    apply: Callable[[nn.Module, Any], None]


@dataclass(frozen=True)
class TensorChunkSplit:
    """How a model's layers compute in tensor chunks in the world-size-invariant mode
    (``parallelism.tensor_parallel_chunks``: the same chunks at every tensor-parallel degree)."""

    # (config, chunks): why the model cannot split into ``chunks`` chunks, in one line; None: it can. Called before
    # any process starts (no model is built).
    check: Callable[[JobConfig, int], str | None]
    # (model or one pipeline stage's part of it, the ChunkPlacement, the ChunkStreams, the tensor-parallel mesh or
    # None): split it in place, before checkpointing, compile and FSDP2; returns each split weight's module and
    # the dimension its weight is split along (0: output features, 1: input features).
    apply: Callable[[nn.Module, Any, Any, Any], list[tuple[nn.Module, int]]]


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
    # How the model splits into pipeline stages; None: it does not (pipeline parallelism is then refused).
    pipeline: PipelineSplit | None = None
    # How its layers split over tensor-parallel ranks; None: they do not (tensor parallelism is then refused, with
    # ``tensor_parallel_refusal`` as the reason when given).
    tensor_parallel: TensorParallelSplit | None = None
    tensor_parallel_refusal: str = ""
    # How its layers compute in tensor chunks in the world-size-invariant mode; None: they do not (that mode then
    # computes them whole, and splits them over no tensor-parallel ranks).
    tensor_chunks: TensorChunkSplit | None = None


_specs: dict[str, TrainSpec] = {}


def register_train_spec(spec: TrainSpec) -> None:
    """Make ``spec`` available as ``model.name = spec.name`` (a later spec of the same name replaces it)."""
    _specs[spec.name] = spec


def registered_specs() -> dict[str, TrainSpec]:
    """Every spec registered so far, by name (``torchtitan_rng.models.get_train_spec`` looks one up)."""
    return _specs
