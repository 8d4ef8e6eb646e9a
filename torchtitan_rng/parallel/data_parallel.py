"""Ordinary data parallelism: each rank trains its own share of the batches, FSDP2 shards the model over
several processes, a step accumulates ``global / (local x processes)`` micro-batches.

A step is an optimizer step: the trainer checkpoints, stops and logs only between two calls of
:meth:`DataParallelPlan.forward_backward`, so no checkpoint ever holds half an accumulation window. The
global streams go on from step to step on every rank (the checkpoint saves and restores them), and a
checkpoint continues exactly only with the process count that saved it; ``checkpoint.on_world_size_change =
"reseed"`` continues inexactly with another (see :meth:`DataParallelPlan.position_data`).
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils.data import Dataset

from torchtitan_rng import device as device_lib
from torchtitan_rng.checkpoint.safe_load import CheckpointInfo
from torchtitan_rng.checkpoint.states import Stateful
from torchtitan_rng.config import JobConfig, gradient_accumulation_steps
from torchtitan_rng.data.sampler import ResumableBatchSampler
from torchtitan_rng.distributed import mean_over_ranks
from torchtitan_rng.errors import CheckpointError
from torchtitan_rng.parallel import wrapping
from torchtitan_rng.parallel.invariant.record import check_checkpoint_mode
from torchtitan_rng.parallel.plan import ParallelPlan, to_device
from torchtitan_rng.train_spec import LossFn, TrainSpec


class DataParallelPlan(ParallelPlan):
    """Every rank its own batches and streams; gradients averaged by FSDP2 (or one process alone)."""

    @classmethod
    def check_config(cls, config: JobConfig, world_size: int) -> None:
        gradient_accumulation_steps(config, world_size)

    @classmethod
    def check_checkpoint(cls, info: CheckpointInfo, world_size: int | None, on_world_size_change: str | None) -> bool:
        check_checkpoint_mode(info, invariant=False)
        saved = info.saved_world_size
        if world_size is None or saved is None or saved == world_size:
            return False
        if on_world_size_change == "reseed":
            return True
        alternative = (' or pass on_world_size_change="reseed" to continue anyway (inexact),' if on_world_size_change
                       else "")
        raise CheckpointError(f"checkpoint {info.path} was saved by {saved} processes and this run has {world_size}: "
                              f"it cannot resume exactly;{alternative} run with {saved} processes")

    @classmethod
    def step_sample_keys(cls, config: JobConfig, num_samples: int, world_size: int, step: int) -> list[list[int]]:
        """Each rank's sampler stands where ``step - 1`` steps of ``accumulation`` batches left it (per-rank
        positions run on across epochs, as in :class:`ResumableBatchSampler`)."""
        accumulation, batch_size = gradient_accumulation_steps(config, world_size), config.training.local_batch_size
        keys: list[list[int]] = []
        for rank in range(world_size):
            sampler = ResumableBatchSampler(num_samples, batch_size, rank, world_size, config.debug.seed)
            epoch, position = divmod((step - 1) * accumulation * batch_size, num_samples // world_size)
            sampler.load_state_dict({"epoch": epoch, "position": position})
            keys += [next(sampler) for _ in range(accumulation)]
        return keys

    def prepare_process(self) -> None:
        if self.config.debug.deterministic:
            device_lib.use_deterministic_algorithms()

    def wrap(self, model: nn.Module, spec: TrainSpec) -> LossFn:
        config, world = self.config, self.world
        wrapping.apply_activation_checkpointing(model, spec, config.activation_checkpoint)
        wrapping.apply_compile(model, spec, config.compile)
        sharded = world.world_size > 1
        if sharded:
            spec.apply_fsdp(model, world.mesh, wrapping.fsdp_mixed_precision(config.training))
        self.compute_context = wrapping.autocast_context(config.training, world.device, sharded)
        return wrapping.compiled_loss(spec.loss_fn, model, config.compile)

    @property
    def micro_batches_per_rank(self) -> int:
        return gradient_accumulation_steps(self.config, self.world.world_size)

    @property
    def samples_per_step(self) -> int:
        return self.config.training.local_batch_size * self.world.world_size * self.micro_batches_per_rank

    def batch_sampler(self, dataset: Dataset) -> None:
        return None

    def record_parts(self) -> dict[str, Stateful]:
        return {}

    def forward_backward(self, model: nn.Module, params: list[nn.Parameter], batches: Iterator[dict[str, Any]],
                         loss_fn: LossFn, step: int) -> torch.Tensor:
        """Take the rank's micro-batches and backpropagate each loss scaled by 1/accumulation (the gradients add
        up to those of the mean loss; FSDP2 averages them over the ranks); returns the mean loss over the
        micro-batches and the ranks."""
        accumulation, device = self.micro_batches_per_rank, self.world.device
        total = torch.zeros((), device=device)
        for _ in range(accumulation):
            batch = to_device(next(batches), device)
            with self.compute_context():
                loss = loss_fn(model, batch, self.config)
            (loss / accumulation).backward()
            total += loss.detach().float()
        return mean_over_ranks(total / accumulation)

    @property
    def carries_streams(self) -> bool:
        return True

    @property
    def loads_dataloader(self) -> bool:
        return True

    def position_data(self, sampler: Any, step: int, saved_world_size: int | None, reseeded: bool) -> None:
        """With another process count (reseeded) the data keeps its global position in the epoch: each of the
        N ranks starts its share of the epoch's permutation at ceil(p * M / N), p being where the M ranks were
        (assuming the same ``training.local_batch_size``)."""
        if not reseeded:
            return
        saved_world = saved_world_size or self.world.world_size
        if not isinstance(sampler, ResumableBatchSampler):  # a streaming source's split is part of its state
            raise CheckpointError(f"a streaming source (data.streaming) cannot be re-split over another process "
                                  f"count: resume with {saved_world} processes")
        per_rank_before = sampler.num_samples // saved_world
        epoch, position = divmod(step * sampler.batch_size, per_rank_before)
        per_rank_now = sampler.num_samples // sampler.dp_world
        position_now = min(per_rank_now, math.ceil(position * saved_world / sampler.dp_world))
        sampler.load_state_dict({"epoch": epoch, "position": position_now})
