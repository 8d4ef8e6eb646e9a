"""Pipeline parallelism: the model split into stages over ``pp`` ranks, each stage sharded by FSDP2 over its
``dp`` ranks, on one 2-D mesh of ``pp x dp`` processes (rank = pp_rank x dp + dp_rank, as torchtitan lays it).

A step is an optimizer step, as in ordinary data parallelism: ``torch.distributed.pipelining`` runs each of the
rank's loader batches as one schedule of ``local_batch_size / pipeline_parallel_microbatch_size`` micro-batches
(the last stage computes each one's loss with the step's loss function, as the other plans do), and the trainer
checkpoints, stops and logs only between steps. Every rank's global streams go on from step to
step and are saved per rank, so each stage's dropout resumes where it stopped; the ranks of one stage's dp group
read the same batches as the ranks of the other stages in their dp column (``data_shard``).

What the bits depend on: the schedule orders each stage's micro-batches (the order of its dropout draws and of
its gradient sums), and the split and the degree say which rank's streams draw for which layers. So a layout
(degree, schedule, split points, micro-batch size) continues exactly only as itself: the run record holds the
four keys and a resume with another is refused, one line per key (``checkpoint.allow_config_change`` names it).
The world-size-invariant mode's stages (``invariant/pipeline.py``) build on this plan and drop that rule.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class
from torch.distributed.tensor import DTensor

from torchtitan_rng.checkpoint.safe_load import CheckpointInfo
from torchtitan_rng.config import ConfigError, JobConfig, Parallelism, gradient_accumulation_steps
from torchtitan_rng.parallel import wrapping
from torchtitan_rng.parallel.data_parallel import DataParallelPlan
from torchtitan_rng.parallel.plan import to_device
from torchtitan_rng.train_spec import Batch, LossFn, PipelineSplit, TrainSpec

_KEY = "parallelism.pipeline_parallel"
_SPLIT_PREFIX = "layers."


def _multi_stage(schedule: str) -> bool:
    """Whether the schedule runs several stages per rank (interleaved, looped, zero-bubble V)."""
    return issubclass(get_schedule_class(schedule), PipelineScheduleMulti)


def stage_count(parallelism: Parallelism) -> int:
    """Stages over all ranks: one per split point plus one; without split points, one per rank (two for a
    schedule that runs several stages per rank)."""
    if parallelism.pipeline_parallel_split_points:
        return len(parallelism.pipeline_parallel_split_points) + 1
    return parallelism.pipeline_parallel_degree * (2 if _multi_stage(parallelism.pipeline_parallel_schedule) else 1)


def split_starts(parallelism: Parallelism) -> list[int]:
    """The first layer of each stage after the first, from ``layers.N`` split points (strictly increasing)."""
    starts = []
    for point in parallelism.pipeline_parallel_split_points:
        number = point[len(_SPLIT_PREFIX):]
        if not (point.startswith(_SPLIT_PREFIX) and number.isdigit()) or int(number) < 1:
            raise ConfigError(f"config {_KEY}_split_points has {point!r}; a split point is layers.N, the first "
                              "layer of a stage (N >= 1)")
        if starts and int(number) <= starts[-1]:
            raise ConfigError(f"config {_KEY}_split_points must increase; {point!r} follows layers.{starts[-1]}")
        starts.append(int(number))
    return starts


def stage_layers(parallelism: Parallelism, n_layers: int) -> list[list[int]]:
    """The layer indices of every stage: at the split points, or as even as they go (earlier stages one more)."""
    count = stage_count(parallelism)
    starts = split_starts(parallelism)
    if not starts:
        per, extra = divmod(n_layers, count)
        starts = [sum(per + (s < extra) for s in range(stage)) for stage in range(1, count)]
    bounds = [0, *starts, n_layers]
    stages = [list(range(bounds[s], bounds[s + 1])) for s in range(count)]
    if any(not layers for layers in stages):
        raise ConfigError(f"the model has {n_layers} layers, too few for {count} pipeline stages with split points "
                          f"{', '.join(f'layers.{n}' for n in starts)}: every stage needs a layer (fewer stages, or "
                          f"{_KEY}_split_points below layers.{n_layers})")
    return stages


def stages_of_rank(parallelism: Parallelism, pp_rank: int) -> list[int]:
    """Which stages a pipeline rank runs: stage s on rank s mod pp (looped), or for a V schedule (ZBV) s on
    rank s in the first half and 2 pp - 1 - s in the second."""
    pp, count = parallelism.pipeline_parallel_degree, stage_count(parallelism)
    if parallelism.pipeline_parallel_schedule == "ZBVZeroBubble":
        return [s for s in range(count) if (s if s < pp else 2 * pp - 1 - s) == pp_rank]
    return [s for s in range(count) if s % pp == pp_rank]


class _LastStageOutput(nn.Module):
    """The model as the step's loss function sees it on the last stage: the schedule has already run the stages
    on the micro-batch, so calling it returns their output."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.output


class PlanStage(PipelineStage):
    """A stage that, when last, tells its plan which micro-batch the schedule's next loss call is for: the schedule
    also calls the loss while it sets the stages up, on uninitialised outputs, and that call is no micro-batch's."""

    def __init__(self, *args: Any, plan: PipelinePlan, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._plan = plan

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if self.is_last:
            self._plan.loss_due = (output, fwd_chunk_id)
        return output


class PipelinePlan(DataParallelPlan):
    """Stages over the mesh's ``pp`` dimension, FSDP2 over its ``dp_shard`` dimension; the checkpoint rules,
    streams and data positions of ordinary data parallelism."""

    def __init__(self, config: JobConfig, world: Any) -> None:
        super().__init__(config, world)
        self.check_config(config, world.world_size)
        self.pp = config.parallelism.pipeline_parallel_degree
        self.dp = world.world_size // self.pp
        self.pp_rank, self.dp_rank = divmod(world.rank, self.dp)
        mesh = init_device_mesh(world.device.type, (self.pp, self.dp), mesh_dim_names=("pp", "dp_shard"))
        self.pp_group = mesh["pp"].get_group()
        self.dp_mesh = mesh["dp_shard"]
        self.stages: list[PipelineStage] = []
        self.schedule: Any = None
        self.split: PipelineSplit | None = None
        self.stage_ids: list[int] = []  # the stages this rank runs
        self._last_losses: list[torch.Tensor] = []
        self._loss_scale = 1.0
        # What the last stage's loss calls of a schedule run take: the step's loss function, the run's
        # micro-batches, and (set by the stage's forward) the output and index of the micro-batch due.
        self._loss_fn: LossFn | None = None
        self._micro_batches: list[Batch] = []
        self.loss_due: tuple[Any, int] | None = None

    @classmethod
    def check_config(cls, config: JobConfig, world_size: int) -> None:
        par, training = config.parallelism, config.training
        pp = par.pipeline_parallel_degree
        if world_size % pp:
            raise ConfigError(f"config {_KEY}_degree = {pp} does not divide the {world_size} processes started; "
                              "start a multiple of it (pp x dp processes)")
        if training.local_batch_size % par.pipeline_parallel_microbatch_size:
            raise ConfigError(f"config {_KEY}_microbatch_size = {par.pipeline_parallel_microbatch_size} does not "
                              f"divide training.local_batch_size = {training.local_batch_size}; choose a divisor")
        if config.validation.enable:
            raise ConfigError(f"config validation.enable: validation runs the whole model, which {_KEY}_degree "
                              f"= {pp} splits over processes; turn validation off")
        gradient_accumulation_steps(config, world_size // pp)
        split_starts(config.parallelism)
        count = stage_count(config.parallelism)
        multi = _multi_stage(par.pipeline_parallel_schedule)
        if count % pp or (count != pp and not multi) or (multi and count < 2 * pp):
            per_rank = "one stage" if not multi else "two or more stages"
            raise ConfigError(f"config {_KEY}_schedule = {par.pipeline_parallel_schedule!r} runs {per_rank} per "
                              f"rank, and {count} stages over pipeline_parallel_degree = {pp} do not; set "
                              f"{_KEY}_split_points to name {pp * (2 if multi else 1) - 1} split points")

    @classmethod
    def check_checkpoint(cls, info: CheckpointInfo, world_size: int | None, on_world_size_change: str | None) -> bool:
        """Only with the process count that saved it: the reseeded continuation re-splits the data by process
        count, which with stages is not the data-parallel count (so ``on_world_size_change`` is not offered)."""
        return super().check_checkpoint(info, world_size, None)

    @classmethod
    def step_sample_keys(cls, config: JobConfig, num_samples: int, world_size: int, step: int) -> list[list[int]]:
        """Rank-major as the sample log gathers them: every rank of a dp column loads that column's batches."""
        dp = world_size // config.parallelism.pipeline_parallel_degree
        per_column = super().step_sample_keys(config, num_samples, dp, step)
        accumulation = len(per_column) // dp
        return [keys for rank in range(world_size)
                for keys in per_column[(rank % dp) * accumulation:(rank % dp + 1) * accumulation]]

    @property
    def data_shard(self) -> tuple[int, int]:
        return self.dp_rank, self.dp

    @property
    def micro_batches_per_rank(self) -> int:
        return gradient_accumulation_steps(self.config, self.dp)

    @property
    def samples_per_step(self) -> int:
        return self.config.training.local_batch_size * self.dp * self.micro_batches_per_rank

    @property
    def pipeline_micro_batches(self) -> int:
        """Micro-batches of one schedule run (one loader batch)."""
        return self.config.training.local_batch_size // self.config.parallelism.pipeline_parallel_microbatch_size

    def wrap(self, model: nn.Module, spec: TrainSpec) -> LossFn:
        config = self.config
        modules = self.split_model(model, spec)
        sharded = self.dp > 1
        if sharded:
            for module in modules:
                spec.apply_fsdp(module, self.dp_mesh, wrapping.fsdp_mixed_precision(config.training))
        self.compute_context = wrapping.autocast_context(config.training, self.world.device, sharded)
        self.build_schedule(modules, functools.partial(PlanStage, plan=self), self.pipeline_micro_batches)
        return spec.loss_fn

    def split_model(self, model: nn.Module, spec: TrainSpec) -> list[nn.Module]:
        """Keep this rank's part of ``model`` (checkpointing and compile applied) and return its stages' modules."""
        if spec.pipeline is None or spec.block_lists is None:
            raise ConfigError(f"model {spec.name!r} does not split into pipeline stages (its train spec has no "
                              f"pipeline split); use {_KEY}_degree 1")
        self.split = spec.pipeline
        layers = stage_layers(self.config.parallelism, len(spec.block_lists(model)[0]))
        count = len(layers)
        self.stage_ids = stages_of_rank(self.config.parallelism, self.pp_rank)
        self.split.prune(model, {index for s in self.stage_ids for index in layers[s]}, 0 in self.stage_ids,
                         count - 1 in self.stage_ids)
        wrapping.apply_activation_checkpointing(model, spec, self.config.activation_checkpoint)
        wrapping.apply_compile(model, spec, self.config.compile)
        return [self.split.stage(model, layers[s], s == 0, s == count - 1) for s in self.stage_ids]

    def build_schedule(self, modules: list[nn.Module], stage_class: Callable[..., PipelineStage],
                       micro_batches: int) -> None:
        """This rank's stages (of ``stage_class``) and the configured schedule of ``micro_batches`` over them."""
        count = stage_count(self.config.parallelism)
        self.stages = [stage_class(module, s, count, self.world.device, group=self.pp_group)
                       for s, module in zip(self.stage_ids, modules)]
        name = self.config.parallelism.pipeline_parallel_schedule
        schedule = get_schedule_class(name)
        try:
            # The plan scales the losses itself (by micro-batches x accumulation): the schedule's own scaling of
            # the gradients after each schedule run would also rescale the gradients accumulated before it.
            self.schedule = schedule(self.stages if issubclass(schedule, PipelineScheduleMulti) else self.stages[0],
                                     n_microbatches=micro_batches, loss_fn=self._micro_batch_loss, scale_grads=False)
        except ValueError as err:  # the schedule's own check of its micro-batches against the stages
            raise ConfigError(f"config {_KEY}_schedule = {name!r} cannot run {micro_batches} micro-batches per "
                              f"schedule run over {count} stages ({err}); give each run more micro-batches") from None

    def _micro_batch_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss: the step's loss function on the micro-batch whose output the last stage gave."""
        assert self.split is not None and self._loss_fn is not None
        due, self.loss_due = self.loss_due, None
        if due is None or due[0] is not output:  # the schedule setting its stages up: only shapes are kept
            return self.split.loss(output, target) / self._loss_scale
        loss = self._loss_fn(_LastStageOutput(output), self._micro_batches[due[1]], self.config)
        self._last_losses.append(loss.detach().float())
        return loss / self._loss_scale

    def run_schedule(self, batch: Batch, micro_batches: list[Batch], loss_fn: LossFn) -> list[torch.Tensor]:
        """One schedule run over ``batch`` (``micro_batches``: its split, as the schedule splits it); the last
        stage's micro-batch losses (by ``loss_fn``), in micro-batch order (none on other stages)."""
        assert self.split is not None
        inputs = (batch[self.split.input_key],) if self._holds_first else ()
        target = batch[self.split.target_key] if self._holds_last else None
        self._loss_fn, self._micro_batches, self._last_losses = loss_fn, micro_batches, []
        with self.compute_context():
            self.schedule.step(*inputs, target=target, return_outputs=False)
        assert len(self._last_losses) == (len(micro_batches) if self._holds_last else 0)
        return self._last_losses

    @property
    def _holds_first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def _holds_last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def forward_backward(self, model: nn.Module, params: list[nn.Parameter], batches: Iterator[dict[str, Any]],
                         loss_fn: LossFn, step: int) -> torch.Tensor:
        """Each of the rank's loader batches through the schedule; each micro-batch's loss scaled by 1/(micro-
        batches x accumulation). Returns the mean loss over the last stage's micro-batches and the dp ranks, the
        same on every rank."""
        accumulation, device = self.micro_batches_per_rank, self.world.device
        micro_batches = self.pipeline_micro_batches
        self._loss_scale = float(micro_batches * accumulation)
        losses: list[torch.Tensor] = []
        for _ in range(accumulation):
            batch = to_device(next(batches), device)
            # Split as the schedule splits its inputs and target (torch.tensor_split along the batch).
            split = {key: value.tensor_split(micro_batches) for key, value in batch.items()}
            losses += self.run_schedule(batch, [{key: parts[i] for key, parts in split.items()}
                                                for i in range(micro_batches)], loss_fn)
        total = torch.zeros((), device=device)
        if self._holds_last:
            total = torch.stack(losses).mean()
        # Only the last stage's ranks add a loss: the sum over all ranks is the sum over the dp ranks.
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total / self.dp

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """The whole model's norm: each stage's (over its dp shards), squared and summed over the stages."""
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared = norm.float() ** 2
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self.pp_group)
        norm = squared.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm if max_norm > 0 else float("inf"), norm)
        return norm
