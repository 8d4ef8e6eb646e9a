"""The world-size-invariant plan: every step the same bits at any process count that divides the step's
micro-batches.

A step's ``training.global_batch_size / training.local_batch_size`` micro-batches are dealt round by round,
one per rank (``step.py``), and summed in slot order (``reduction.py``); on several processes FSDP2 shards
parameters, gradients and optimizer state (its reduce-scatter replaced by the slot-order exchange), every
process runs fixed kernels, and each micro-batch seeds the global streams from ``(seed, step, slot)`` and
each of its blocks from ``(seed, step, slot, layer)`` (``streams.py``): no stream is carried from step to step,
and the data position follows from the step alone, so a checkpoint continues at any such process count
(``record.py`` marks it as this mode's; DCP reshards it), and with pipeline stages too (``pipeline.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.data import Dataset

from torchtitan_rng.checkpoint.safe_load import CheckpointInfo
from torchtitan_rng.checkpoint.states import Stateful
from torchtitan_rng.config import Debug, JobConfig
from torchtitan_rng.data.global_sampler import GlobalBatchSampler
from torchtitan_rng.parallel import wrapping
from torchtitan_rng.parallel.invariant import reduction, setup, step as invariant_step
from torchtitan_rng.parallel.invariant.streams import MicroBatchStreams
from torchtitan_rng.parallel.invariant.record import RECORD_PART, InvariantRecord, check_checkpoint_mode
from torchtitan_rng.parallel.plan import ParallelPlan, to_device
from torchtitan_rng.rng import preserved_global_rng, seed_micro_batch_streams
from torchtitan_rng.train_spec import LossFn, TrainSpec


def hooked_streams(model: nn.Module, spec: TrainSpec, debug: Debug) -> MicroBatchStreams:
    """The micro-batch streams, reseeded at each of ``model``'s blocks (call it once the blocks are wrapped)."""
    streams = MicroBatchStreams(debug.seed)
    if spec.block_lists is not None:  # a model without blocks draws from its micro-batch's stream alone
        streams.hook_blocks(spec.block_lists(model))
    return streams


class InvariantPlan(ParallelPlan):
    """``parallelism.world_size_invariant``: one micro-batch per rank per round of a step, summed in slot order."""

    layout: invariant_step.Layout | None = None  # set by batch_sampler(), which sees the dataset
    exchanges: Sequence[reduction.SlotOrderExchange] = ()  # set by wrap() when sharded
    streams: MicroBatchStreams  # set by wrap()

    @classmethod
    def check_config(cls, config: JobConfig, world_size: int) -> None:
        setup.check_batch_layout(config, world_size)

    @classmethod
    def check_checkpoint(cls, info: CheckpointInfo, world_size: int | None, on_world_size_change: str | None) -> bool:
        check_checkpoint_mode(info, invariant=True)
        return False  # any process count continues it exactly

    @classmethod
    def layout_keys(cls) -> tuple[str, ...]:
        """How many processes, pipeline stages and which schedule: the same bits under every value."""
        return ("parallelism.data_parallel_shard_degree", "parallelism.pipeline_parallel_degree",
                "parallelism.pipeline_parallel_schedule", "parallelism.pipeline_parallel_microbatch_size",
                "parallelism.pipeline_parallel_split_points")

    @classmethod
    def step_sample_keys(cls, config: JobConfig, num_samples: int, world_size: int, step: int) -> list[list[int]]:
        """Rank-major: rank r's slots r, r + W, ... (``step.Layout``); the same micro-batches at any count."""
        micro_batches = setup.check_batch_layout(config, world_size)
        sampler = GlobalBatchSampler(num_samples, config.training.local_batch_size, micro_batches, 0, 1,
                                     config.debug.seed)
        return [sampler.keys_of(step - 1, slot) for rank in range(world_size)
                for slot in range(rank, micro_batches, world_size)]

    def prepare_process(self) -> None:
        setup.use_fixed_kernels()

    def wrap(self, model: nn.Module, spec: TrainSpec) -> LossFn:
        config = self.config
        wrapping.apply_activation_checkpointing(model, spec, config.activation_checkpoint)
        wrapping.apply_compile(model, spec, config.compile)
        self.streams = hooked_streams(model, spec, config.debug)
        if self.world.world_size > 1:
            # FSDP2 gathers float32 parameters at every count, so that bf16 compute is the same autocast as on
            # one process (where nothing is sharded) and gradients reach the exchange in float32.
            spec.apply_fsdp(model, self.world.mesh, MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                         reduce_dtype=torch.float32))
            self.exchanges = reduction.use_slot_order_exchange(model)
        self.compute_context = wrapping.autocast_context(config.training, self.world.device, sharded=False)
        return wrapping.compiled_loss(spec.loss_fn, model, config.compile)

    @property
    def micro_batches_per_rank(self) -> int:
        ranks = self.data_shard[1]  # the ranks that run different micro-batches
        return setup.check_batch_layout(self.config, ranks) // ranks

    @property
    def samples_per_step(self) -> int:
        return self.config.training.global_batch_size

    def batch_sampler(self, dataset: Dataset) -> GlobalBatchSampler:
        self.layout = setup.plan_layout(self.config, *self.data_shard, dataset)
        return setup.global_sampler(len(dataset), self.config, self.layout)

    def record_parts(self) -> dict[str, Stateful]:
        return {RECORD_PART: InvariantRecord(self.config.training)}

    def forward_backward(self, model: nn.Module, params: list[nn.Parameter], batches: Iterator[dict[str, Any]],
                         loss_fn: LossFn, step: int) -> torch.Tensor:
        assert self.layout is not None, "batch_sampler() places the micro-batches first"
        return invariant_step.forward_backward(model, params, lambda: to_device(next(batches), self.world.device),
                                               loss_fn, self.config, self.layout, step, self.compute_context,
                                               self.exchanges, self.streams)

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        return reduction.clip_grads(params, max_norm, reduction.grad_norm(params, self.world.world_size))

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
