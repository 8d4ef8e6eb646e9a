"""The world-size-invariant numerics: every step the same bits at any process count that divides the step's
micro-batches, with or without pipeline stages (any degree, schedule offered here, split points or dp count).

A step's ``training.global_batch_size / training.local_batch_size`` micro-batches are dealt round by round, one
per data shard (``step.py``: shard ``c`` runs slots ``c, c + dp, ...``; with stages a shard is a dp column, a
pipeline micro-batch is one of them and one schedule run takes all of a column's), and summed in slot order
(``reduction.py``); on several processes FSDP2 shards parameters, gradients and optimizer state (its
reduce-scatter replaced by the slot-order exchange), every process runs fixed kernels, and each micro-batch seeds
the global streams from ``(seed, step, slot)`` and each of its blocks from ``(seed, step, slot, layer)``
(``streams.py``), never by rank or stage: no stream is carried from step to step, and the data position follows
from the step alone, so a checkpoint continues at any such process count and layout (``mode.py`` marks it as this
mode's; DCP reshards it).

Gradients with stages: every stage's backwards run in micro-batch order in the schedules offered here, so autograd
adds them in slot order within a column; across the ``dp`` ranks of a stage each micro-batch's gradient goes
through the slot-order exchange at its own backward (not once per schedule run, as FSDP2 under pipelining does).
The loss and the gradient norm: the micro-batch losses summed in slot order, and every parameter's row squares put
in the whole model's parameter order before one sum (``reduction.py``).

Refused with stages: the zero-bubble schedules, which compute a micro-batch's weight gradient apart from its input
gradient, in a pass the exchange does not see, and LoopedBFS, which runs a stage's backwards in reverse
micro-batch order.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.data import Dataset

from torchtitan_rng.checkpoint.layout import CheckpointInfo
from torchtitan_rng.checkpoint.states import Stateful
from torchtitan_rng.config import ConfigError, Data, JobConfig, Parallelism, Training
from torchtitan_rng.data.global_sampler import GlobalBatchSampler
from torchtitan_rng.parallel.invariant import reduction, setup
from torchtitan_rng.parallel.invariant.chunks import ChunkPlacement
from torchtitan_rng.parallel.invariant.step import Slots, divide_grads, mean_loss_in_slot_order
from torchtitan_rng.parallel.invariant.streams import ChunkStreams, MicroBatchStreams
from torchtitan_rng.parallel.mode import RECORD_PART, InvariantRecord, check_checkpoint_mode
from torchtitan_rng.parallel.numerics import Numerics
from torchtitan_rng.rng import preserved_global_rng, seed_micro_batch_streams
from torchtitan_rng.train_spec import TrainSpec, registered_specs

if TYPE_CHECKING:
    from torchtitan_rng.parallel.layout import Layout
    from torchtitan_rng.parallel.tensor import TensorDimension

_FLAG = "--parallelism.world_size_invariant"
# The schedules this mode refuses, and why: the order of a stage's gradient sum would not be slot order.
_SPLIT = ("computes each micro-batch's weight gradient in a separate pass, outside the exchange that adds the "
          "micro-batches in one order")
REFUSED_SCHEDULES = {
    "InterleavedZeroBubble": _SPLIT,
    "ZBVZeroBubble": _SPLIT,
    "LoopedBFS": "runs a stage's backwards in reverse micro-batch order, so its gradients would add in another order",
}


def _no_chunks(model: str) -> str:
    return (f"{_FLAG}: model {model!r} computes no layer in tensor chunks, so it splits over no tensor-parallel "
            "ranks; set parallelism.tensor_parallel_degree to 1")


class DerivedNumerics(Numerics):
    """``parallelism.world_size_invariant``: one micro-batch per data shard per round of a step, streams derived
    per micro-batch and block, summed in slot order."""

    carries_streams = False
    any_process_count = True
    reduces_each_micro_batch = True
    microbatch_default = "training.local_batch_size, this mode's micro-batch"

    def __init__(self, config: JobConfig, data_shard: tuple[int, int], device: torch.device) -> None:
        super().__init__(config, data_shard, device)
        self.slots: Slots | None = None  # set by batch_sampler(), which sees the dataset
        self.exchanges: list[reduction.SlotOrderExchange] = []  # one per FSDP2 module, when sharded
        self.streams = MicroBatchStreams(config.debug.seed)
        self.placement = ChunkPlacement(1)  # the layers' tensor chunks (split_layers)
        self.split_weights: list[tuple[nn.Module, int]] = []  # the split layers and their weight's split dimension

    @classmethod
    def check_stages(cls, parallelism: Parallelism, training: Training) -> None:
        par = parallelism
        if par.pipeline_parallel_schedule in REFUSED_SCHEDULES:
            raise ConfigError(f"{_FLAG}: parallelism.pipeline_parallel_schedule = {par.pipeline_parallel_schedule!r} "
                              f"{REFUSED_SCHEDULES[par.pipeline_parallel_schedule]}; use GPipe, 1F1B or "
                              "Interleaved1F1B")
        if cls.microbatch_size(par, training) != training.local_batch_size:
            raise ConfigError(f"{_FLAG}: a pipeline micro-batch is the mode's micro-batch, so "
                              f"parallelism.pipeline_parallel_microbatch_size = {par.pipeline_parallel_microbatch_size}"
                              f" must be training.local_batch_size = {training.local_batch_size}; set it so, or leave "
                              "it unset (0)")

    @classmethod
    def microbatch_size(cls, parallelism: Parallelism, training: Training) -> int:
        """Unset: training.local_batch_size, the one size this mode runs."""
        return parallelism.pipeline_parallel_microbatch_size or training.local_batch_size

    @classmethod
    def check_data(cls, training: Training, data: Data, data_ranks: int, ranks: str) -> None:
        setup.check_batch_layout(training, data, data_ranks, ranks=ranks)

    @classmethod
    def check_tensor_parallel(cls, config: JobConfig) -> None:
        """The model's split dimensions divide into ``parallelism.tensor_parallel_chunks`` chunks, and the chunks
        into the tensor-parallel degree (a model without tensor chunks splits over no tensor-parallel ranks)."""
        par = config.parallelism
        chunks, degree = par.tensor_parallel_chunks, par.tensor_parallel_degree
        spec = registered_specs().get(config.model.name)
        if spec is not None and spec.tensor_chunks is None:  # None: a custom module's spec, checked when built
            if degree > 1:
                raise ConfigError(_no_chunks(spec.name))
            return
        if chunks % degree:
            counts = ", ".join(str(n) for n in range(1, chunks + 1) if chunks % n == 0)
            raise ConfigError(f"{_FLAG}: parallelism.tensor_parallel_degree = {degree} does not divide "
                              f"parallelism.tensor_parallel_chunks = {chunks} (every degree computes the same chunks); "
                              f"use a degree among {counts}, or more chunks (a new run: the chunks set the bits)")
        problem = spec.tensor_chunks.check(config, chunks) if spec is not None and chunks > 1 else None
        if problem is not None:
            raise ConfigError(f"{_FLAG}: {problem}")

    @classmethod
    def check_checkpoint(cls, info: CheckpointInfo, world_size: int | None, on_world_size_change: str | None,
                         tensor_parallel_degree: int = 1) -> bool:
        check_checkpoint_mode(info, invariant=True)
        return False  # any process count continues it exactly

    @classmethod
    def layout_keys(cls) -> tuple[str, ...]:
        """How many processes, tensor-parallel ranks, pipeline stages and which schedule: the same bits under
        every value."""
        return ("parallelism.data_parallel_shard_degree", "parallelism.tensor_parallel_degree",
                "parallelism.pipeline_parallel_degree",
                "parallelism.pipeline_parallel_schedule", "parallelism.pipeline_parallel_microbatch_size",
                "parallelism.pipeline_parallel_split_points")

    @classmethod
    def step_sample_keys(cls, config: JobConfig, num_samples: int, data_ranks: int, step: int) -> list[list[int]]:
        """By slot: the same micro-batches in the same order at any count (shard c runs slots c, c + W, ...)."""
        micro_batches = setup.check_batch_layout(config.training, config.data, data_ranks)
        sampler = GlobalBatchSampler(num_samples, config.training.local_batch_size, micro_batches, 0, 1,
                                     config.debug.seed)
        return [sampler.keys_of(step - 1, slot) for slot in range(micro_batches)]

    def prepare_process(self) -> None:
        setup.use_fixed_kernels()

    def fsdp_policy(self) -> MixedPrecisionPolicy:
        """FSDP2 gathers float32 parameters at every count, so that bf16 compute is the same autocast as on one
        process (where nothing is sharded) and gradients reach the exchange in float32."""
        return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)

    @property
    def casts_by_fsdp(self) -> bool:
        return False

    def split_layers(self, model: nn.Module, spec: TrainSpec, tensor: TensorDimension) -> None:
        """The model's split layers in ``parallelism.tensor_parallel_chunks`` chunks at every degree, this rank's
        of them when the layout's tensor-parallel dimension splits them (``chunks.py``); nothing when the model has
        no such split or the chunks are 1 (then the degree is 1)."""
        chunks, tensor_mesh = self.config.parallelism.tensor_parallel_chunks, tensor.mesh
        if spec.tensor_chunks is None and tensor_mesh is not None:  # a custom module's spec, unchecked before
            raise ConfigError(_no_chunks(spec.name))
        if spec.tensor_chunks is None or chunks == 1:
            return
        if tensor_mesh is None:
            self.placement = ChunkPlacement(chunks)
        else:
            self.placement = ChunkPlacement(chunks, tensor_mesh.size(), tensor_mesh.get_local_rank(),
                                            tensor_mesh.get_group())
        self.split_weights += spec.tensor_chunks.apply(model, self.placement,
                                                       ChunkStreams(self.config.debug.seed, self.device), tensor_mesh)

    def hook_model(self, model: nn.Module, spec: TrainSpec) -> None:
        """Reseed at each of ``model``'s blocks (a model without blocks draws from its micro-batch's stream
        alone)."""
        if spec.block_lists is not None:
            self.streams.hook_blocks(spec.block_lists(model))

    def sharded(self, module: nn.Module) -> None:
        self.exchanges += reduction.use_slot_order_exchange(module)

    @property
    def micro_batches_per_rank(self) -> int:
        return setup.check_batch_layout(self.config.training, self.config.data, self.data_ranks) // self.data_ranks

    @property
    def samples_per_step(self) -> int:
        return self.config.training.global_batch_size

    def slot(self, shard: int, index: int) -> int:
        """Round ``index`` of shard ``shard`` (``step.Slots``)."""
        return index * self.data_ranks + shard

    def batch_sampler(self, dataset: Dataset) -> GlobalBatchSampler:
        config, slots = self.config, setup.plan_slots(self.config.training, self.config.data, self.data_rank,
                                                      self.data_ranks, dataset)
        self.slots = slots
        return GlobalBatchSampler(len(dataset), config.training.local_batch_size, slots.micro_batches, slots.rank,
                                  slots.world, config.debug.seed)

    def record_parts(self) -> dict[str, Stateful]:
        return {RECORD_PART: InvariantRecord(self.config.training)}

    @property
    def schedule_takes_whole_step(self) -> bool:
        return True

    def begin_step(self, step: int) -> None:
        assert self.slots is not None, "batch_sampler() places the micro-batches first"
        for exchange in self.exchanges:
            exchange.begin_step()

    def enter_micro_batch(self, step: int, index: int) -> None:
        assert self.slots is not None
        self.streams.enter(step, self.slots.slot(index))

    def loss_scale(self, micro_batches: int) -> float:
        return 1.0  # the sum in slot order, divided once (finish_grads)

    def after_backward(self, index: int, micro_batches: int, params: list[nn.Parameter]) -> None:
        if self.exchanges and index < micro_batches - 1:
            for p in params:  # the gradients are views of the exchanges' shards: FSDP2 must assign, not add
                p.grad = None

    def finish_grads(self, params: list[nn.Parameter]) -> None:
        assert self.slots is not None
        divide_grads(params, self.slots)

    def step_loss(self, losses: list[torch.Tensor], layout: Layout) -> torch.Tensor:
        assert self.slots is not None
        loss = torch.zeros((), device=self.device)
        if layout.holds_loss:
            loss = mean_loss_in_slot_order(torch.stack(losses), self.slots, layout.data_group)
        return layout.share_loss(loss)

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float, layout: Layout) -> torch.Tensor:
        """The norm from the same vector of row squares at every layout: each parameter's (assembled over the
        ranks that hold this rank's stages; a row of a weight split by input features summed chunk by chunk, then
        by the chunk tree), in the whole model's parameter order."""
        split_dims = {id(module.weight): dim for module, dim in self.split_weights}
        parts = reduction.row_squares(params, layout.stage_group, split_dims, self.placement)
        return reduction.clip_grads(params, max_norm, reduction.norm_of(layout.in_model_order(params, parts)))

    @contextlib.contextmanager
    def step_streams(self, step: int) -> Iterator[None]:
        assert self.slots is not None
        with preserved_global_rng(self.device):
            seed_micro_batch_streams(self.config.debug.seed, step, self.slots.first_slot)
            yield

    def data_position(self, dataloader: Any) -> Stateful:
        return dataloader.batch_sampler  # the rest of the loader's state is not restored in this mode

    @property
    def loads_dataloader(self) -> bool:
        return False

    def position_data(self, sampler: Any, step: int, saved_data_ranks: int | None, reseeded: bool) -> None:
        sampler.load_state_dict({"step": step, "slot": 0})
