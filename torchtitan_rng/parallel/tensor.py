"""The tensor-parallel dimension of a layout: ``parallelism.tensor_parallel_degree`` ranks split each layer's
weights with torch's own tensor-parallel API (``parallelize_module`` and DTensor), as the model's train spec plans
it (:class:`~torchtitan_rng.train_spec.TensorParallelSplit`).

Both layouts carry it as the innermost dimension of their mesh, as torchtitan lays it out: ``dp_shard x tp``
without stages, ``pp x dp_shard x tp`` with them (rank = (pp_rank x dp + dp_rank) x tp + tp_rank). The split is
applied to the model (or a stage's part of it) before activation checkpointing, compile and FSDP2; FSDP2 then
shards the DTensor parameters over ``dp_shard``.

The ranks of a tensor-parallel group read the same batches (one data shard) and hold the same random streams:
their global streams are seeded from the data shard and stage (:attr:`TensorDimension.stream_rank`), never from
the tensor-parallel rank, so an activation they replicate draws the same dropout mask on every one of them.
DTensor's own random ops draw from each rank's CPU generator on a CPU mesh; on an accelerator its offset-based
tracker moves the device generator (created here without its broadcast of rank 0's state, which would make every
data shard draw alike). The tracker keeps no state of its own, so the saved global streams carry all of it.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan_rng import device as device_lib
from torchtitan_rng.checkpoint import run_record
from torchtitan_rng.checkpoint.layout import CheckpointInfo
from torchtitan_rng.config import ConfigError, JobConfig
from torchtitan_rng.train_spec import TrainSpec, registered_specs

KEY = "parallelism.tensor_parallel_degree"


def saved_tensor_degree(info: CheckpointInfo) -> int:
    """The tensor-parallel degree that saved a checkpoint (its run record's; 1 without one)."""
    record = run_record.read_record(info.path) or {}
    return int(record.get("config", {}).get(KEY, 1))


def saved_data_ranks(info: CheckpointInfo) -> int | None:
    """The data shards of the run that saved a checkpoint: its processes over its tensor-parallel degree (None:
    not known)."""
    saved = info.saved_world_size
    return saved // saved_tensor_degree(info) if saved is not None else None


def check_config(config: JobConfig) -> None:
    """Refuse, before any process starts, a degree the model cannot split into (the spec's own line)."""
    degree = config.parallelism.tensor_parallel_degree
    if degree == 1:
        return
    spec = registered_specs().get(config.model.name)
    if spec is None:  # a spec of job.custom_module: checked when the trainer builds it
        return
    problem = refusal(spec, config, degree)
    if problem is not None:
        raise ConfigError(problem)


def refusal(spec: TrainSpec, config: JobConfig, degree: int) -> str | None:
    """Why ``degree`` tensor-parallel ranks cannot split ``spec``'s model, in one line; None when they can."""
    if spec.tensor_parallel is None:
        why = f" ({spec.tensor_parallel_refusal})" if spec.tensor_parallel_refusal else ""
        return (f"config {KEY} = {degree}: model {spec.name!r} does not split over tensor-parallel ranks{why}; run it "
                f"with --{KEY} 1")
    problem = spec.tensor_parallel.check(config, degree)
    return f"config {KEY} = {degree}: {problem}" if problem is not None else None


class TensorDimension:
    """This rank's place on the tensor-parallel dimension of a layout's mesh (``tp`` 1: no such dimension)."""

    def __init__(self, config: JobConfig, mesh: DeviceMesh | None, stream_rank: int) -> None:
        self.config = config
        self.degree = config.parallelism.tensor_parallel_degree
        self.mesh = mesh["tp"] if mesh is not None and self.degree > 1 else None
        self.stream_rank = stream_rank  # what seeds this rank's global streams: its data shard and stage

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The ranks that split one layer between them (None: no tensor parallelism)."""
        return self.mesh.get_group() if self.mesh is not None else None

    def split(self, module: nn.Module, spec: TrainSpec) -> None:
        """Split ``module`` (the model or this rank's stages of it) over the group, as the spec plans it."""
        if self.mesh is None:
            return
        problem = refusal(spec, self.config, self.degree)
        if problem is not None:
            raise ConfigError(problem)
        assert spec.tensor_parallel is not None
        spec.tensor_parallel.apply(module, self.mesh)
        device_lib.prepare_dtensor_random(self.mesh)

    def describe(self) -> str:
        return f"tensor parallel: tp {self.degree}" if self.mesh is not None else ""


class ReplicatedParallel(ParallelStyle):
    """A module every rank of the group computes whole (a norm between split layers): its parameters become
    replicated DTensors on the mesh (one mesh for every parameter, as FSDP2 and the gradient norm need), its input
    and output stay plain tensors."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, _replicated_input, _local_output)


def _replicated_input(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) if not isinstance(x, DTensor) else x
                 for x in inputs)


def _local_output(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
    return output.to_local() if isinstance(output, DTensor) else output
