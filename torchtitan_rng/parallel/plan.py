"""How a training step is split over processes: the interface every parallel mode implements.

One plan per mode, chosen once from the config (:func:`torchtitan_rng.parallel.plan_class`); the trainer, the
resume, the launcher's preflight and the diagnosis ask the plan and never which mode they are in. A plan owns:

* what a process must fix before it computes (kernels, threads: :meth:`prepare_process`);
* how parameters are wrapped (activation checkpointing, compile, sharding) and the compute context
  (:meth:`wrap`);
* which micro-batches a rank runs (:meth:`batch_sampler`, :attr:`micro_batches_per_rank`) and how many samples
  a step takes (:attr:`samples_per_step`);
* how a step's gradients are reduced and what loss it reports (:meth:`forward_backward`), and the norm they
  are clipped by (:meth:`clip_grad_norm`);
* which ranks read the same batches (:attr:`data_shard`);
* which streams enter a step (:attr:`carries_streams`, :meth:`step_streams`, :meth:`data_position`);
* what the checkpoint records about the layout, what a checkpoint of another layout or process count means
  (:meth:`record_parts`, :meth:`check_checkpoint`, :meth:`layout_keys`), and where the data stands after a resume
  (:meth:`position_data`).

Today's modes: ``data_parallel.py`` (ordinary data parallelism, FSDP2 over several processes),
``pipeline.py`` (pipeline stages x FSDP2) and ``invariant/`` (world-size-invariant: the same bits at any
process count; ``invariant/pipeline.py`` with pipeline stages too).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset

from torchtitan_rng.checkpoint.safe_load import CheckpointInfo
from torchtitan_rng.checkpoint.states import Stateful
from torchtitan_rng.config import JobConfig
from torchtitan_rng.distributed import World
from torchtitan_rng.train_spec import Batch, LossFn, TrainSpec


def to_device(batch: dict[str, Any], device: torch.device) -> Batch:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


class ParallelPlan(ABC):
    """How one run's steps are split over its processes; built once, after the process group."""

    def __init__(self, config: JobConfig, world: World) -> None:
        self.config = config
        self.world = world
        self.compute_context: Callable[[], ContextManager] = contextlib.nullcontext  # set by wrap()

    # --- before any process starts (the launcher's preflight) and at start-up -----------------------------
    @classmethod
    @abstractmethod
    def check_config(cls, config: JobConfig, world_size: int) -> None:
        """Raise ConfigError when ``world_size`` processes cannot run this config in this mode."""

    @classmethod
    @abstractmethod
    def check_checkpoint(cls, info: CheckpointInfo, world_size: int | None, on_world_size_change: str | None) -> bool:
        """Whether this mode can continue ``info`` with ``world_size`` processes (None: not known yet): raises
        CheckpointError when it cannot, returns True when it goes on inexactly with reseeded streams and data
        (the process count changed and ``on_world_size_change="reseed"`` allows it; None: no such option is
        offered), False for an exact resume."""

    @classmethod
    @abstractmethod
    def step_sample_keys(cls, config: JobConfig, num_samples: int, world_size: int, step: int) -> list[list[int]]:
        """The sample keys of each micro-batch of ``step`` of a map-style run of ``world_size`` processes over
        ``num_samples`` samples per epoch, rank-major (as ``metrics.log_samples`` writes them), from the config
        alone."""

    @classmethod
    def layout_keys(cls) -> tuple[str, ...]:
        """Config keys that only lay a step out over processes, this mode giving the same bits whatever their
        value: a resume may change them without a word (the run record does not compare them)."""
        return ()

    @abstractmethod
    def prepare_process(self) -> None:
        """Process-wide settings every computation of the run depends on (kernels, threads)."""

    # --- building ----------------------------------------------------------------------------------------
    @abstractmethod
    def wrap(self, model: nn.Module, spec: TrainSpec) -> LossFn:
        """Wrap the built model in place (checkpointing, compile, sharding), set :attr:`compute_context`, and
        return the loss function to train with (compiled when asked)."""

    @property
    @abstractmethod
    def micro_batches_per_rank(self) -> int:
        """Batches a rank takes from its loader per optimizer step."""

    @property
    @abstractmethod
    def samples_per_step(self) -> int:
        """Samples one optimizer step trains on, over all ranks."""

    @abstractmethod
    def batch_sampler(self, dataset: Dataset) -> Any:
        """The batch sampler of this rank's loader; None: the loader's own per-rank sampler. Raises ConfigError
        when the dataset cannot be split this way."""

    @abstractmethod
    def record_parts(self) -> dict[str, Stateful]:
        """Checkpoint parts that record this mode's layout (checked again when loaded)."""

    # --- a step ------------------------------------------------------------------------------------------
    @abstractmethod
    def forward_backward(self, model: nn.Module, params: list[nn.Parameter], batches: Iterator[dict[str, Any]],
                         loss_fn: LossFn, step: int) -> torch.Tensor:
        """Run this rank's micro-batches of ``step``, leave the step's gradients in ``p.grad`` (reduced over the
        ranks), and return the step's loss as logged (the same value on every rank)."""

    # --- streams and data position -----------------------------------------------------------------------
    @property
    @abstractmethod
    def carries_streams(self) -> bool:
        """True when the global streams go on from step to step (saved and restored with the checkpoint);
        False when each step seeds them itself."""

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip this rank's gradients by the total norm of the whole model's (``max_norm`` 0: off) and return
        that norm as a 0-d tensor on the device (the loss log reads it later, with no sync here)."""
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return norm

    @property
    def data_shard(self) -> tuple[int, int]:
        """(this rank's share, the number of shares) of the data: ranks of one share read the same batches."""
        return self.world.rank, self.world.world_size

    def step_streams(self, step: int) -> ContextManager:
        """Within it, the global streams stand as the first micro-batch of ``step`` on this rank will draw them
        (for fingerprints); no stream of the run moves. Carried streams already stand so."""
        return contextlib.nullcontext()

    def data_position(self, dataloader: Any) -> Stateful:
        """What carries this rank's data position across a resume (fingerprinted as the "dataloader" stream)."""
        return dataloader

    @abstractmethod
    def position_data(self, sampler: Any, step: int, saved_world_size: int | None, reseeded: bool) -> None:
        """After a checkpoint of ``step`` was loaded: put the data where ``step`` leaves it, when the loader's
        own state was not loaded (another process count, or a mode that does not restore it)."""

    @property
    @abstractmethod
    def loads_dataloader(self) -> bool:
        """Whether a resume loads the loader's saved state (else :meth:`position_data` sets its position)."""
