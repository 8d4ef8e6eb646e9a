"""Where a step runs: which ranks hold which stages and which data shards, how many micro-batches each rank runs,
and the mesh. The interface, and the layout without stages.

Two layouts today: :class:`FlatLayout` here (every rank the whole model and its own data shard, FSDP2 over all
processes) and ``pipeline.py`` (stages over ``pp`` ranks, each sharded over its ``dp`` ranks). Both have a
tensor-parallel dimension (``tensor.py``: ``tp`` ranks split each layer and share a data shard), the innermost of
their mesh. A layout runs the micro-batches of a step and asks its
:class:`~torchtitan_rng.parallel.numerics.Numerics` at the points where the numerics differ; a new axis (context
parallelism, replicated shards) is a new layout or a new dimension of the mesh.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, Callable, ContextManager, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from torchtitan_rng.config import JobConfig, Parallelism
from torchtitan_rng.distributed import World, data_parallel_degree, mean_over_ranks
from torchtitan_rng.parallel import tensor, wrapping
from torchtitan_rng.parallel.numerics import Numerics
from torchtitan_rng.train_spec import Batch, LossFn, TrainSpec


# The keys that say how stages run: without stages they mean nothing.
MICROBATCH_KEY = "parallelism.pipeline_parallel_microbatch_size"
STAGE_KEYS = ("parallelism.pipeline_parallel_schedule", MICROBATCH_KEY, "parallelism.pipeline_parallel_split_points")


def to_device(batch: dict[str, Any], device: torch.device) -> Batch:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


class Layout(ABC):
    """The ranks of one run and what each holds; built once, after the process group."""

    # Whether a checkpoint of another process count may continue (inexactly) with the data re-split by count.
    reseeds_by_process_count = False

    def __init__(self, config: JobConfig, world: World) -> None:
        self.config = config
        self.world = world
        self.compute_context: Callable[[], ContextManager] = contextlib.nullcontext  # set by wrap()
        self.tensor = tensor.TensorDimension(config, None, world.rank)  # the layout sets its own from its mesh

    # --- before any process starts ---------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def check_config(cls, config: JobConfig, world_size: int, numerics: type[Numerics]) -> None:
        """Raise ConfigError when ``world_size`` processes cannot lay this config out (with ``numerics``)."""

    @classmethod
    @abstractmethod
    def data_ranks(cls, parallelism: Parallelism, world_size: int) -> int:
        """How many data shards ``world_size`` processes make (each shard's ranks read the same batches)."""

    @classmethod
    @abstractmethod
    def compared(cls, values: dict[str, Any], parallelism: Parallelism,
                 blocks: Callable[[], int | None]) -> dict[str, Any]:
        """A run record's config ``values`` (whose section is ``parallelism``) with its pipeline keys as this layout
        runs them (:meth:`Mode.compared`); ``blocks()``: the model's repeated blocks (None: not known)."""

    # --- building ----------------------------------------------------------------------------------------
    def describe(self, numerics: Numerics) -> str:
        """What the run prints of its layout beyond its process count, once built ("": nothing)."""
        return ""

    @property
    def data_shard(self) -> tuple[int, int]:
        """(this rank's share, the number of shares) of the data: ranks of one share read the same batches."""
        return self.world.rank, self.world.world_size

    @property
    def data_group(self) -> dist.ProcessGroup | None:
        """The ranks that read different data (None: all)."""
        return None

    @property
    def stream_rank(self) -> int:
        """What seeds this rank's global streams: its data shard and stage, the same on every rank of a
        tensor-parallel group (the process rank when there is none)."""
        return self.tensor.stream_rank

    @property
    def tensor_group(self) -> dist.ProcessGroup | None:
        """The ranks that split this rank's layers with it (None: no tensor parallelism)."""
        return self.tensor.group

    @property
    def stage_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold this rank's part of the model between them (None: all)."""
        return None

    @abstractmethod
    def wrap(self, model: nn.Module, spec: TrainSpec, numerics: Numerics) -> LossFn:
        """As :meth:`ParallelPlan.wrap`."""

    # --- a step ------------------------------------------------------------------------------------------
    @abstractmethod
    def forward_backward(self, model: nn.Module, params: list[nn.Parameter], batches: Iterator[dict[str, Any]],
                         loss_fn: LossFn, step: int, numerics: Numerics) -> torch.Tensor:
        """As :meth:`ParallelPlan.forward_backward`."""

    @property
    def holds_loss(self) -> bool:
        """Whether this rank computes micro-batch losses (with stages: the last stage's ranks)."""
        return True

    def share_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss that the ranks holding losses agree on, given to every rank (the others hold 0)."""
        return loss

    @abstractmethod
    def mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean of every rank's micro-batch losses, as this layout's collectives sum it."""

    @abstractmethod
    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip by the whole model's gradient norm, as this layout's collectives sum it; returns the norm."""

    def in_model_order(self, params: list[nn.Parameter], parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-parameter values of this rank's ``params`` (those with a gradient), as the whole model's."""
        return parts


class FlatLayout(Layout):
    """Every rank the whole model (split over its tensor-parallel group, when ``tp`` > 1) and its data shard; FSDP2
    over the ``dp`` data shards (nothing on one). Mesh ``dp_shard x tp``: rank = dp_rank x tp + tp_rank."""

    reseeds_by_process_count = True

    def __init__(self, config: JobConfig, world: World) -> None:
        super().__init__(config, world)
        tp = config.parallelism.tensor_parallel_degree
        self.dp = data_parallel_degree(config.parallelism, world.world_size)
        self.dp_rank = world.rank // tp
        if tp == 1:  # the process group's own mesh: no groups to build
            self.mesh = self.dp_mesh = world.mesh
        else:
            self.mesh = init_device_mesh(world.device.type, (self.dp, tp), mesh_dim_names=("dp_shard", "tp"))
            self.dp_mesh = self.mesh["dp_shard"]
        self.tensor = tensor.TensorDimension(config, self.mesh, self.dp_rank)

    @classmethod
    def check_config(cls, config: JobConfig, world_size: int, numerics: type[Numerics]) -> None:
        dp = data_parallel_degree(config.parallelism, world_size)
        ranks = "processes" if config.parallelism.tensor_parallel_degree == 1 else \
            "data-parallel ranks (processes / tensor_parallel_degree)"
        numerics.check_data(config.training, config.data, dp, ranks)
        numerics.check_tensor_parallel(config)
        tensor.check_config(config)

    @classmethod
    def data_ranks(cls, parallelism: Parallelism, world_size: int) -> int:
        """Each tensor-parallel group one shard (the pipeline keys mean nothing without stages)."""
        return world_size // parallelism.tensor_parallel_degree

    @classmethod
    def compared(cls, values: dict[str, Any], parallelism: Parallelism,
                 blocks: Callable[[], int | None]) -> dict[str, Any]:
        """Without stages the stage keys mean nothing: left out; so is the tensor-parallel degree, which the
        checkpoint rule judges with the process count (:meth:`Mode.check_checkpoint`)."""
        return {key: value for key, value in values.items() if key not in (*STAGE_KEYS, tensor.KEY)}

    def describe(self, numerics: Numerics) -> str:
        if self.tensor.mesh is None:
            return ""
        return f"tensor parallel: dp {self.dp} x tp {self.tensor.degree}"

    @property
    def data_shard(self) -> tuple[int, int]:
        return self.dp_rank, self.dp

    @property
    def data_group(self) -> dist.ProcessGroup | None:
        return self.dp_mesh.get_group() if self.tensor.mesh is not None else None

    def wrap(self, model: nn.Module, spec: TrainSpec, numerics: Numerics) -> LossFn:
        config = self.config
        numerics.split_layers(model, spec, self.tensor)
        wrapping.apply_activation_checkpointing(model, spec, config.activation_checkpoint)
        wrapping.apply_compile(model, spec, config.compile)
        numerics.hook_model(model, spec)
        sharded = self.dp > 1
        if sharded:
            spec.apply_fsdp(model, self.dp_mesh, numerics.fsdp_policy())
            numerics.sharded(model)
        self.compute_context = wrapping.autocast_context(config.training, self.world.device,
                                                         sharded and numerics.casts_by_fsdp)
        return wrapping.compiled_loss(spec.loss_fn, model, config.compile)

    def forward_backward(self, model: nn.Module, params: list[nn.Parameter], batches: Iterator[dict[str, Any]],
                         loss_fn: LossFn, step: int, numerics: Numerics) -> torch.Tensor:
        """The rank's micro-batches one after the other, each loss's backward before the next forward."""
        micro_batches = numerics.micro_batches_per_rank
        scale = numerics.loss_scale(micro_batches)
        numerics.begin_step(step)
        losses = []
        for index in range(micro_batches):
            batch = to_device(next(batches), self.world.device)
            numerics.enter_micro_batch(step, index)
            with self.compute_context():
                loss = loss_fn(model, batch, self.config.training)
            (loss / scale).backward()
            losses.append(loss.detach().float())
            numerics.after_backward(index, micro_batches, params)
        numerics.finish_grads(params)
        return numerics.step_loss(losses, self)

    def mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros((), device=self.world.device)
        for loss in losses:
            total += loss
        return mean_over_ranks(total / len(losses), self.data_group)

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """The norm as FSDP2 computes it over the shards (a 0-d tensor on the device: no sync here)."""
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return norm
