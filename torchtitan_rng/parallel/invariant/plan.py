"""The world-size-invariant plan: every step the same bits at any power-of-two process count.

A step's ``training.global_batch_size / training.local_batch_size`` micro-batches are split into contiguous
blocks, one per rank (``step.py``), summed in one canonical tree (``reduction.py``); parameters are replicated
(no FSDP), every process runs fixed kernels, and each micro-batch seeds the global streams from
``(seed, step, slot)``: no stream is carried from step to step, and the data position follows from the step
alone, so a checkpoint continues at any process count (``record.py`` marks it as this mode's).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils.data import Dataset

from torchtitan_rng.checkpoint.safe_load import CheckpointInfo
from torchtitan_rng.checkpoint.states import Stateful
from torchtitan_rng.config import JobConfig
from torchtitan_rng.data.global_sampler import GlobalBatchSampler
from torchtitan_rng.parallel import wrapping
from torchtitan_rng.parallel.invariant import setup, step as invariant_step
from torchtitan_rng.parallel.invariant.record import RECORD_PART, InvariantRecord, check_checkpoint_mode
from torchtitan_rng.parallel.plan import ParallelPlan, to_device
from torchtitan_rng.rng import preserved_global_rng, seed_micro_batch_streams
from torchtitan_rng.train_spec import LossFn, TrainSpec

class InvariantPlan(ParallelPlan):
    """``parallelism.world_size_invariant``: this rank's block of each step's micro-batches, a canonical sum."""

    layout: invariant_step.Layout | None = None  # set by batch_sampler(), which sees the dataset

    @classmethod
    def check_config(cls, config: JobConfig, world_size: int) -> None:
        setup.check_batch_layout(config, world_size)

    @classmethod
    def check_checkpoint(cls, info: CheckpointInfo, world_size: int | None, on_world_size_change: str | None) -> bool:
        check_checkpoint_mode(info, invariant=True)
        return False  # any process count continues it exactly

    @classmethod
    def step_sample_keys(cls, config: JobConfig, num_samples: int, world_size: int, step: int) -> list[list[int]]:
        """Global slots in order, the same at any process count."""
        micro_batches = setup.check_batch_layout(config, 1)
        sampler = GlobalBatchSampler(num_samples, config.training.local_batch_size, micro_batches, 0, 1,
                                     config.debug.seed)
        return [sampler.keys_of(step - 1, slot) for slot in range(micro_batches)]

    def prepare_process(self) -> None:
        setup.use_fixed_kernels()

    def wrap(self, model: nn.Module, spec: TrainSpec) -> LossFn:
        config = self.config
        wrapping.apply_activation_checkpointing(model, spec, config)
        wrapping.apply_compile(model, spec, config)
        # Parameters are replicated: nothing casts them, so bf16 compute is autocast around forward and loss.
        self.compute_context = wrapping.autocast_context(config, self.world.device, sharded=False)
        return wrapping.compiled_loss(spec.loss_fn, model, config)

    @property
    def micro_batches_per_rank(self) -> int:
        return setup.check_batch_layout(self.config, self.world.world_size) // self.world.world_size

    @property
    def samples_per_step(self) -> int:
        return self.config.training.global_batch_size

    def batch_sampler(self, dataset: Dataset) -> GlobalBatchSampler:
        self.layout = setup.plan_layout(self.config, self.world.rank, self.world.world_size, dataset)
        return setup.global_sampler(len(dataset), self.config, self.layout)

    def record_parts(self) -> dict[str, Stateful]:
        return {RECORD_PART: InvariantRecord(self.config)}

    def forward_backward(self, model: nn.Module, params: list[nn.Parameter], batches: Iterator[dict[str, Any]],
                         loss_fn: LossFn, step: int) -> torch.Tensor:
        assert self.layout is not None, "batch_sampler() places the micro-batches first"
        return invariant_step.forward_backward(model, params, lambda: to_device(next(batches), self.world.device),
                                               loss_fn, self.config, self.layout, step, self.compute_context)

    @property
    def carries_streams(self) -> bool:
        return False

    @contextlib.contextmanager
    def step_streams(self, step: int) -> Iterator[None]:
        assert self.layout is not None
        with preserved_global_rng(self.world.device):
            seed_micro_batch_streams(self.config.debug.seed, step, self.layout.first_slot)
            yield

    def data_position(self, dataloader: Any) -> Stateful:
        return dataloader.batch_sampler  # the rest of the loader's state is not restored in this mode

    @property
    def loads_dataloader(self) -> bool:
        return False

    def position_data(self, sampler: Any, step: int, saved_world_size: int | None, reseeded: bool) -> None:
        sampler.load_state_dict({"step": step, "slot": 0})
