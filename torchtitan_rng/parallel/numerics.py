"""What a step computes with, whatever the layout: where its random numbers come from, how its gradients and loss
are reduced, which kernels run, what a checkpoint of it continues as. The interface, and the ordinary numerics.

Two numerics today: :class:`CarriedNumerics` here (every rank's global streams go on from step to step and are
saved per rank; FSDP2 reduce-scatters the gradients; a checkpoint continues exactly only with the process count
that saved it) and ``invariant/numerics.py`` (streams derived per micro-batch and block, the slot-order exchange,
fixed kernels: the same bits at any process count). A :class:`~torchtitan_rng.parallel.layout.Layout` runs the
micro-batches; it asks its numerics at the points where the two differ.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.data import Dataset

from torchtitan_rng import device as device_lib
from torchtitan_rng.checkpoint.layout import CheckpointInfo
from torchtitan_rng.checkpoint.states import Stateful
from torchtitan_rng.config import Data, JobConfig, Parallelism, Training, gradient_accumulation_steps
from torchtitan_rng.data.sampler import ResumableBatchSampler
from torchtitan_rng.errors import CheckpointError
from torchtitan_rng.parallel import wrapping
from torchtitan_rng.parallel.mode import check_checkpoint_mode
from torchtitan_rng.parallel.tensor import KEY as TENSOR_KEY, saved_tensor_degree
from torchtitan_rng.train_spec import TrainSpec

if TYPE_CHECKING:
    from torchtitan_rng.parallel.layout import Layout
    from torchtitan_rng.parallel.tensor import TensorDimension


class Numerics(ABC):
    """How a step's numbers are drawn and summed; built once per run from the config and the layout's data
    shard (this rank's share, the number of shares)."""

    # As :attr:`ParallelPlan.carries_streams`: whether the global streams go on from step to step.
    carries_streams: ClassVar[bool]
    # Whether a step's samples, streams and sums are the same at every process count that divides it.
    any_process_count: ClassVar[bool]
    # Whether each micro-batch's gradient is reduced at its own backward, also under a pipeline schedule (which
    # would otherwise reduce once per schedule run).
    reduces_each_micro_batch: ClassVar[bool] = False
    # What an unset parallelism.pipeline_parallel_microbatch_size means (see :meth:`microbatch_size`).
    microbatch_default: ClassVar[str] = "1"

    def __init__(self, config: JobConfig, data_shard: tuple[int, int], device: torch.device) -> None:
        self.config = config
        self.data_rank, self.data_ranks = data_shard
        self.device = device

    # --- before any process starts ---------------------------------------------------------------------------
    @classmethod
    def check_stages(cls, parallelism: Parallelism, training: Training) -> None:
        """Raise ConfigError when these numerics cannot run the configured pipeline schedule (stages only)."""

    @classmethod
    def microbatch_size(cls, parallelism: Parallelism, training: Training) -> int:
        """Samples per pipeline micro-batch: ``parallelism.pipeline_parallel_microbatch_size``, or when it is unset
        (0) what these numerics run by default."""
        return parallelism.pipeline_parallel_microbatch_size or 1

    @classmethod
    @abstractmethod
    def check_data(cls, training: Training, data: Data, data_ranks: int, ranks: str) -> None:
        """Raise ConfigError when ``data_ranks`` ranks reading different data (named ``ranks``) cannot split a
        step's samples."""

    @classmethod
    def check_tensor_parallel(cls, config: JobConfig) -> None:
        """Raise ConfigError when these numerics cannot split the model's layers as ``config`` asks (over
        ``parallelism.tensor_parallel_degree`` ranks)."""

    @classmethod
    @abstractmethod
    def check_checkpoint(cls, info: CheckpointInfo, world_size: int | None, on_world_size_change: str | None,
                         tensor_parallel_degree: int = 1) -> bool:
        """As :meth:`Mode.check_checkpoint` (``tensor_parallel_degree``: this run's)."""

    @classmethod
    def layout_keys(cls) -> tuple[str, ...]:
        """As :meth:`ParallelPlan.layout_keys`."""
        return ()

    @classmethod
    @abstractmethod
    def step_sample_keys(cls, config: JobConfig, num_samples: int, data_ranks: int, step: int) -> list[list[int]]:
        """The keys of each micro-batch of ``step`` over ``data_ranks`` data shards, in slot order (:meth:`slot`)."""

    # --- the process and the model ---------------------------------------------------------------------------
    @abstractmethod
    def prepare_process(self) -> None:
        """As :meth:`ParallelPlan.prepare_process`."""

    @abstractmethod
    def fsdp_policy(self) -> MixedPrecisionPolicy:
        """The mixed-precision policy FSDP2 shards with."""

    @property
    @abstractmethod
    def casts_by_fsdp(self) -> bool:
        """Whether FSDP2's policy casts the parameters for compute (else autocast does, sharded or not)."""

    def split_layers(self, model: nn.Module, spec: TrainSpec, tensor: TensorDimension) -> None:
        """Before checkpointing and compile wrap ``model`` (this rank's part of it): how its layers compute split
        over the layout's tensor-parallel dimension; torch's tensor-parallel styles, as the spec plans them."""
        tensor.split(model, spec)

    def hook_model(self, model: nn.Module, spec: TrainSpec) -> None:
        """After checkpointing and compile wrapped the blocks of ``model`` (this rank's part of it)."""

    def sharded(self, module: nn.Module) -> None:
        """After FSDP2 sharded ``module``."""

    # --- the data ------------------------------------------------------------------------------------------
    @property
    @abstractmethod
    def micro_batches_per_rank(self) -> int:
        """Loader batches a rank takes per optimizer step."""

    @property
    @abstractmethod
    def samples_per_step(self) -> int:
        """Samples one optimizer step trains on, over all ranks."""

    @abstractmethod
    def batch_sampler(self, dataset: Dataset) -> Any:
        """As :meth:`ParallelPlan.batch_sampler`."""

    @abstractmethod
    def slot(self, shard: int, index: int) -> int:
        """As :meth:`ParallelPlan.slot`."""

    @abstractmethod
    def record_parts(self) -> dict[str, Stateful]:
        """As :meth:`ParallelPlan.record_parts`."""

    # --- a step --------------------------------------------------------------------------------------------
    @property
    def schedule_takes_whole_step(self) -> bool:
        """With stages: one schedule run takes all of a rank's loader batches of a step (else one each)."""
        return False

    def begin_step(self, step: int) -> None:
        """Before the first micro-batch of ``step``."""

    def enter_micro_batch(self, step: int, index: int) -> None:
        """Before the forward of this rank's micro-batch ``index`` (loader batch order) of ``step``."""

    @abstractmethod
    def loss_scale(self, micro_batches: int) -> float:
        """What each micro-batch's loss is divided by before its backward (``micro_batches``: the rank's per
        step)."""

    def after_backward(self, index: int, micro_batches: int, params: list[nn.Parameter]) -> None:
        """After the backward of micro-batch ``index`` of the rank's ``micro_batches`` (no stages)."""

    def finish_grads(self, params: list[nn.Parameter]) -> None:
        """After the last backward of a step."""

    @abstractmethod
    def step_loss(self, losses: list[torch.Tensor], layout: Layout) -> torch.Tensor:
        """The step's loss as logged (the same on every rank) from this rank's micro-batch losses."""

    @abstractmethod
    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float, layout: Layout) -> torch.Tensor:
        """As :meth:`ParallelPlan.clip_grad_norm`."""

    # --- streams and data position -------------------------------------------------------------------------
    def step_streams(self, step: int) -> ContextManager:
        """As :meth:`ParallelPlan.step_streams`."""
        return contextlib.nullcontext()

    def data_position(self, dataloader: Any) -> Stateful:
        """As :meth:`ParallelPlan.data_position`."""
        return dataloader

    @property
    @abstractmethod
    def loads_dataloader(self) -> bool:
        """As :attr:`ParallelPlan.loads_dataloader`."""

    @abstractmethod
    def position_data(self, sampler: Any, step: int, saved_data_ranks: int | None, reseeded: bool) -> None:
        """As :meth:`ParallelPlan.position_data`."""


class CarriedNumerics(Numerics):
    """Ordinary training: each rank's streams go on from step to step, each data shard reads its own batches
    (``global / (local x shards)`` per step, accumulated), FSDP2's reduce-scatter and mixed-precision policy,
    each micro-batch's loss scaled by 1/(micro-batches per rank) before its backward.

    A step is an optimizer step: the trainer checkpoints, stops and logs only between two steps, so no
    checkpoint ever holds half an accumulation window. A checkpoint continues exactly only with the process
    count that saved it; ``checkpoint.on_world_size_change = "reseed"`` continues inexactly with another
    (see :meth:`position_data`)."""

    carries_streams = True
    any_process_count = False

    @classmethod
    def check_data(cls, training: Training, data: Data, data_ranks: int, ranks: str) -> None:
        gradient_accumulation_steps(training, data_ranks)

    @classmethod
    def check_checkpoint(cls, info: CheckpointInfo, world_size: int | None, on_world_size_change: str | None,
                         tensor_parallel_degree: int = 1) -> bool:
        """Exact only with the process count and tensor-parallel degree that saved it (each rank's streams, the
        split of every sum); another continues inexactly with ``on_world_size_change="reseed"``."""
        check_checkpoint_mode(info, invariant=False)
        saved, saved_tp, tp = info.saved_world_size, saved_tensor_degree(info), tensor_parallel_degree
        count_differs = world_size is not None and saved is not None and saved != world_size
        if not count_differs and saved_tp == tp:
            return False
        if on_world_size_change == "reseed":
            return True
        alternative = (' or pass on_world_size_change="reseed" to continue anyway (inexact),' if on_world_size_change
                       else "")
        if saved_tp == tp:
            raise CheckpointError(f"checkpoint {info.path} was saved by {saved} processes and this run has "
                                  f"{world_size}: it cannot resume exactly;{alternative} run with {saved} processes")
        count = f"{saved} processes at " if count_differs else ""
        now = f"{world_size} at " if count_differs else ""
        raise CheckpointError(f"checkpoint {info.path} was saved by {count}{TENSOR_KEY} = {saved_tp} and this run has "
                              f"{now}{tp}: it cannot resume exactly (each rank's streams and the split of every sum "
                              f"follow the degree);{alternative} run with --{TENSOR_KEY} {saved_tp}"
                              f"{f' on {saved} processes' if count_differs else ''}")

    @classmethod
    def step_sample_keys(cls, config: JobConfig, num_samples: int, data_ranks: int, step: int) -> list[list[int]]:
        """Each shard's sampler stands where ``step - 1`` steps of ``accumulation`` batches left it (per-shard
        positions run on across epochs, as in :class:`ResumableBatchSampler`); shard-major, the slot order."""
        training = config.training
        accumulation, batch_size = gradient_accumulation_steps(training, data_ranks), training.local_batch_size
        keys: list[list[int]] = []
        for rank in range(data_ranks):
            sampler = ResumableBatchSampler(num_samples, batch_size, rank, data_ranks, config.debug.seed)
            epoch, position = divmod((step - 1) * accumulation * batch_size, num_samples // data_ranks)
            sampler.load_state_dict({"epoch": epoch, "position": position})
            keys += [next(sampler) for _ in range(accumulation)]
        return keys

    def prepare_process(self) -> None:
        if self.config.debug.deterministic:
            device_lib.use_deterministic_algorithms()

    def fsdp_policy(self) -> MixedPrecisionPolicy:
        return wrapping.fsdp_mixed_precision(self.config.training)

    @property
    def casts_by_fsdp(self) -> bool:
        return True

    @property
    def micro_batches_per_rank(self) -> int:
        return gradient_accumulation_steps(self.config.training, self.data_ranks)

    @property
    def samples_per_step(self) -> int:
        return self.config.training.local_batch_size * self.data_ranks * self.micro_batches_per_rank

    def batch_sampler(self, dataset: Dataset) -> None:
        return None

    def slot(self, shard: int, index: int) -> int:
        """Shard-major: each shard's loader batches one after the other."""
        return shard * self.micro_batches_per_rank + index

    def record_parts(self) -> dict[str, Stateful]:
        return {}

    def loss_scale(self, micro_batches: int) -> float:
        """The gradients add up to those of the mean loss; FSDP2 averages them over the shards."""
        return float(micro_batches)

    def step_loss(self, losses: list[torch.Tensor], layout: Layout) -> torch.Tensor:
        return layout.mean_loss(losses)

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float, layout: Layout) -> torch.Tensor:
        return layout.clip_grad_norm(params, max_norm)

    @property
    def loads_dataloader(self) -> bool:
        return True

    def position_data(self, sampler: Any, step: int, saved_data_ranks: int | None, reseeded: bool) -> None:
        """With another count of data shards (reseeded) the data keeps its global position in the epoch: each of
        the N shards starts its share of the epoch's permutation at ceil(p * M / N), p being where the M shards
        were (assuming the same ``training.local_batch_size``)."""
        if not reseeded:
            return
        saved_world = saved_data_ranks or self.data_ranks
        if not isinstance(sampler, ResumableBatchSampler):  # a streaming source's split is part of its state
            raise CheckpointError(f"a streaming source (data.streaming) cannot be re-split over another process "
                                  f"count: resume with {saved_world} processes")
        per_rank_before = sampler.num_samples // saved_world
        epoch, position = divmod(step * sampler.batch_size, per_rank_before)
        per_rank_now = sampler.num_samples // sampler.dp_world
        position_now = min(per_rank_now, math.ceil(position * saved_world / sampler.dp_world))
        sampler.load_state_dict({"epoch": epoch, "position": position_now})
