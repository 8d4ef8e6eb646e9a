"""World-size-invariant training with pipeline stages: the bits of the invariant mode without stages, whatever
the pipeline degree, schedule, split points or data-parallel count.

The layout (pp x dp ranks, ``pipeline.py``) changes nothing a micro-batch computes:

* Micro-batches: a step's ``M = global / local`` micro-batches are dealt over the ``dp`` columns as the invariant
  mode deals them over ranks (column ``c`` runs slots ``c, c + dp, ...``); a pipeline micro-batch is one of them
  (``pipeline_parallel_microbatch_size = local_batch_size``), and one schedule run takes all of a column's.
* Randomness: each stage seeds the global streams per (step, slot) before a micro-batch's forward and per
  (step, slot, layer) before each block (``streams.py``), never per rank or stage.
* Gradients: every stage's backwards run in micro-batch order in the schedules offered here,
  so autograd adds them in slot order within a column; across the ``dp`` ranks of a stage each micro-batch's
  gradient goes through the slot-order exchange at its own backward (not once per schedule run, as FSDP2 under
  pipelining does), which adds round by round in slot order: ``g_0 + g_1 + ... + g_{M-1}``, as one process.
* The loss and the gradient norm: the last stage's micro-batch losses summed in slot order, and every parameter's
  row squares put in the whole model's parameter order before one sum (``reduction.py``).

Refused in this mode: the zero-bubble schedules, which compute a micro-batch's weight gradient apart from its
input gradient, in a pass the exchange does not see, and LoopedBFS, which runs a stage's backwards in reverse
micro-batch order.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.pipelining._backward import stage_backward

from torchtitan_rng.config import ConfigError, JobConfig
from torchtitan_rng.parallel import wrapping
from torchtitan_rng.parallel.invariant import reduction, setup
from torchtitan_rng.parallel.invariant.plan import InvariantPlan, hooked_streams
from torchtitan_rng.parallel.invariant.step import divide_grads, mean_loss_in_slot_order
from torchtitan_rng.parallel.pipeline import PipelinePlan, PlanStage
from torchtitan_rng.parallel.plan import to_device
from torchtitan_rng.train_spec import LossFn, TrainSpec

_FLAG = "--parallelism.world_size_invariant"
# The schedules this mode refuses, and why: the order of a stage's gradient sum would not be slot order.
_SPLIT = ("computes each micro-batch's weight gradient in a separate pass, outside the exchange that adds the "
          "micro-batches in one order")
REFUSED_SCHEDULES = {
    "InterleavedZeroBubble": _SPLIT,
    "ZBVZeroBubble": _SPLIT,
    "LoopedBFS": "runs a stage's backwards in reverse micro-batch order, so its gradients would add in another order",
}
_WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod")  # what activation checkpointing and compile insert


def _plain_name(name: str) -> str:
    """A parameter's name in the unwrapped model."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


class _InvariantStage(PlanStage):
    """A stage whose micro-batch ``i`` draws as its column's slot ``i`` and, when sharded, whose every
    micro-batch's gradient goes through the slot-order exchange at its own backward."""

    def __init__(self, *args: Any, plan: InvariantPipelinePlan, **kwargs: Any) -> None:
        super().__init__(*args, plan=plan, **kwargs)
        self._plan: InvariantPipelinePlan = plan
        self._backwards = 0  # this step's backwards so far

    def begin_step(self) -> None:
        self._backwards = 0

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        plan = self._plan
        assert plan.layout is not None
        plan.streams.enter(plan.step, plan.layout.slot(fwd_chunk_id))
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        if not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        assert backward_type == "full", "the split-backward schedules are refused in this mode"
        # Reduce now, as a backward outside pipelining would: FSDP2's hooks run the exchange for this micro-batch.
        self.submod.set_is_last_backward(True)
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        self._backwards += 1
        assert self._plan.layout is not None
        if self._backwards < self._plan.layout.per_rank:
            # The gradients are views of the exchanges' shards: FSDP2 must assign the next ones, not add them.
            # Cleared now, when the backward has resharded every parameter (a root module's stay unsharded
            # from its forward to its backward, and clearing those would leave the sharded ones' views).
            for p in self.submod.parameters():
                p.grad = None
        return grads, None


class InvariantPipelinePlan(InvariantPlan, PipelinePlan):
    """``parallelism.world_size_invariant`` with ``pipeline_parallel_degree > 1``: the invariant plan's rules for
    checkpoints, streams and data (by dp column), the pipeline plan's mesh and stages."""

    step = 0  # the step being run (the stages key their micro-batches' streams by it)

    @classmethod
    def check_config(cls, config: JobConfig, world_size: int) -> None:
        par = config.parallelism
        if par.pipeline_parallel_schedule in REFUSED_SCHEDULES:
            raise ConfigError(f"{_FLAG}: parallelism.pipeline_parallel_schedule = {par.pipeline_parallel_schedule!r} "
                              f"{REFUSED_SCHEDULES[par.pipeline_parallel_schedule]}; use GPipe, 1F1B or "
                              "Interleaved1F1B")
        if par.pipeline_parallel_microbatch_size != config.training.local_batch_size:
            raise ConfigError(f"{_FLAG}: a pipeline micro-batch is the mode's micro-batch, so "
                              f"parallelism.pipeline_parallel_microbatch_size = {par.pipeline_parallel_microbatch_size}"
                              f" must be training.local_batch_size = {config.training.local_batch_size}; set it so")
        if world_size % par.pipeline_parallel_degree == 0:  # else the pipeline's check below says so
            setup.check_batch_layout(config, world_size // par.pipeline_parallel_degree,
                                     ranks="data-parallel ranks (processes / pipeline_parallel_degree)")
        PipelinePlan.check_config(config, world_size)

    @classmethod
    def step_sample_keys(cls, config: JobConfig, num_samples: int, world_size: int, step: int) -> list[list[int]]:
        """Rank-major: every rank of dp column ``c`` loads the column's slots ``c, c + dp, ...``."""
        dp = world_size // config.parallelism.pipeline_parallel_degree
        per_column = InvariantPlan.step_sample_keys(config, num_samples, dp, step)
        per_rank = len(per_column) // dp
        return [keys for rank in range(world_size)
                for keys in per_column[(rank % dp) * per_rank:(rank % dp + 1) * per_rank]]

    def wrap(self, model: nn.Module, spec: TrainSpec) -> LossFn:
        self._order = [name for name, p in model.named_parameters() if p.requires_grad]  # the whole model's
        modules = self.split_model(model, spec)
        self.streams = hooked_streams(model, spec, self.config.debug)
        if self.dp > 1:
            # float32 gathers and reductions, as the invariant mode without stages (see plan.py)
            policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
            for module in modules:
                spec.apply_fsdp(module, self.dp_mesh, policy)
            self.exchanges = [exchange for module in modules
                              for exchange in reduction.use_slot_order_exchange(module)]
        self._names = [_plain_name(name) for name, p in model.named_parameters() if p.requires_grad]
        self.compute_context = wrapping.autocast_context(self.config.training, self.world.device, sharded=False)
        self.build_schedule(modules, functools.partial(_InvariantStage, plan=self), self.micro_batches_per_rank)
        return spec.loss_fn

    def forward_backward(self, model: nn.Module, params: list[nn.Parameter], batches: Iterator[dict[str, Any]],
                         loss_fn: LossFn, step: int) -> torch.Tensor:
        """One schedule run over the column's micro-batches (the schedule splits the concatenated batch back into
        them, in order); the mean gradient and loss over all ``M`` micro-batches, the loss the same on every
        rank."""
        layout = self.layout
        assert layout is not None and self.split is not None, "batch_sampler() and wrap() come first"
        self.step = step
        for exchange in self.exchanges:
            exchange.begin_step()
        for stage in self.stages:
            stage.begin_step()
        loaded = [to_device(next(batches), self.world.device) for _ in range(layout.per_rank)]
        self._loss_scale = 1.0
        losses = self.run_schedule({key: torch.cat([b[key] for b in loaded]) for key in loaded[0]}, loaded, loss_fn)
        divide_grads(params, layout)
        loss = torch.zeros((), device=self.world.device)
        if self._holds_last:
            loss = mean_loss_in_slot_order(torch.stack(losses), layout, self.dp_mesh.get_group())
        # One rank of each pipeline group holds the loss, the others 0: the sum is that loss, unrounded.
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.pp_group)
        return loss

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """The norm of the whole model's gradient from the same vector of row squares as without stages: each
        stage's (gathered over its dp ranks), gathered over the stages and put in the whole model's order."""
        assert len(params) == len(self._names), "the trainer steps the model's trainable parameters"
        parts = reduction.row_squares(params, self.dp, self.dp_mesh.get_group())
        names = [name for name, p in zip(self._names, params) if p.grad is not None]
        everyone: list[Any] = [None] * self.pp
        dist.all_gather_object(everyone, {name: part.cpu() for name, part in zip(names, parts)}, group=self.pp_group)
        squares = {name: part for stage_parts in everyone for name, part in stage_parts.items()}
        norm = reduction.norm_of([squares[name].to(self.world.device) for name in self._order if name in squares])
        return reduction.clip_grads(params, max_norm, norm)
