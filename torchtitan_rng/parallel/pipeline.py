"""The staged layout: the model split into stages over ``pp`` ranks, each stage sharded by FSDP2 over its ``dp``
ranks and split over its ``tp`` ranks (``tensor.py``), on one 3-D mesh of ``pp x dp x tp`` processes (rank =
(pp_rank x dp + dp_rank) x tp + tp_rank, as torchtitan lays it; ``data_parallel_shard_degree x
tensor_parallel_degree x pipeline_parallel_degree`` = the process count).

A step is an optimizer step, as without stages: ``torch.distributed.pipelining`` runs the rank's loader batches
through the schedule, each split into ``local_batch_size / pipeline_parallel_microbatch_size`` micro-batches (the
last stage computes each one's loss with the step's loss function), and the trainer checkpoints, stops and logs
only between steps. The ranks of one stage's dp group read the same batches as the ranks of the other stages in
their dp column (``data_shard``).

With the ordinary numerics (carried streams) the bits depend on the layout: the schedule orders each stage's
micro-batches (the order of its dropout draws and of its gradient sums), and the split and the degree say which
rank's streams draw for which layers. So a layout (degree, schedule, split points, micro-batch size) continues
exactly only as itself: the run record holds the four keys and a resume with another is refused, one line per key
(``checkpoint.allow_config_change`` names it). The world-size-invariant numerics drop that rule
(``invariant/numerics.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class
from torch.distributed.tensor import DTensor

from torchtitan_rng.config import ConfigError, JobConfig, Parallelism, Training
from torchtitan_rng.distributed import World, data_parallel_degree
from torchtitan_rng.parallel import tensor, wrapping
from torchtitan_rng.parallel.layout import Layout, to_device
from torchtitan_rng.parallel.tensor import TensorDimension
from torchtitan_rng.parallel.numerics import Numerics
from torchtitan_rng.train_spec import Batch, LossFn, PipelineSplit, TrainSpec, registered_specs

_KEY = "parallelism.pipeline_parallel"
_SPLIT_PREFIX = "layers."
_SPLIT_KEY = f"{_KEY}_split_points"
_WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod")  # what activation checkpointing and compile insert


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


def stage_layers(parallelism: Parallelism, n_layers: int, deeper: str = "") -> list[list[int]]:
    """The layer indices of every stage: at the split points, or as even as they go (earlier stages one more).
    ``deeper``: the overrides that give the model enough layers (the model's :class:`PipelineSplit` says), for
    the refusal of too many stages."""
    count = stage_count(parallelism)
    named = split_starts(parallelism)
    per, extra = divmod(n_layers, count)
    starts = named or [sum(per + (s < extra) for s in range(stage)) for stage in range(1, count)]
    bounds = [0, *starts, n_layers]
    stages = [list(range(bounds[s], bounds[s + 1])) for s in range(count)]
    if all(stages):
        return stages
    if named:
        raise ConfigError(f"the model has {n_layers} layers, too few for {count} pipeline stages with split points "
                          f"{', '.join(f'layers.{n}' for n in starts)}: every stage needs a layer (fewer stages, or "
                          f"{_KEY}_split_points below layers.{n_layers})")
    schedule, pp = parallelism.pipeline_parallel_schedule, parallelism.pipeline_parallel_degree
    multi = _multi_stage(schedule)
    fewer = (f"--{_KEY}_schedule 1F1B (one stage per rank)" if multi
             else f"--{_KEY}_degree {n_layers} (or fewer stages)")
    raise ConfigError(f"the model has {n_layers} layers, too few for the {count} pipeline stages "
                      f"{_KEY}_schedule = {schedule!r} runs over {_KEY}_degree = {pp} "
                      f"({'two' if multi else 'one'} per rank): every stage needs a layer; pass "
                      f"{deeper or f'a model with {count} or more layers'}, or {fewer}")


def describe_stages(parallelism: Parallelism, training: Training, numerics: type[Numerics], dp: int,
                    layers: list[list[int]]) -> str:
    """The run's pipeline in one line: degrees, schedule, each stage's layers, and the micro-batch size as resolved
    (an unset one says what it was resolved from)."""
    size = numerics.microbatch_size(parallelism, training)
    resolved = (f"; {_KEY}_microbatch_size unset: {numerics.microbatch_default}"
                if not parallelism.pipeline_parallel_microbatch_size else "")
    stages = " | ".join(",".join(map(str, stage)) for stage in layers)
    return (f"pipeline: pp {parallelism.pipeline_parallel_degree} x dp {dp}, schedule "
            f"{parallelism.pipeline_parallel_schedule}, {len(layers)} stages (layers {stages}); micro-batches of "
            f"{size} sample(s), {training.local_batch_size // size} per loader batch{resolved}")


def _does_not_split(model: str, pp: int) -> str:
    return (f"config {_KEY}_degree = {pp}: model {model!r} does not split into pipeline stages (its train spec has "
            f"no pipeline split); run it with --{_KEY}_degree 1")


def stages_of_rank(parallelism: Parallelism, pp_rank: int) -> list[int]:
    """Which stages a pipeline rank runs: stage s on rank s mod pp (looped), or for a V schedule (ZBV) s on
    rank s in the first half and 2 pp - 1 - s in the second."""
    pp, count = parallelism.pipeline_parallel_degree, stage_count(parallelism)
    if parallelism.pipeline_parallel_schedule == "ZBVZeroBubble":
        return [s for s in range(count) if (s if s < pp else 2 * pp - 1 - s) == pp_rank]
    return [s for s in range(count) if s % pp == pp_rank]


def _plain_name(name: str) -> str:
    """A parameter's name in the unwrapped model."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


class _LastStageOutput(nn.Module):
    """The model as the step's loss function sees it on the last stage: the schedule has already run the stages
    on the micro-batch, so calling it returns their output."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.output


@dataclass
class _ScheduleRun:
    """One schedule run: what its loss calls and its stages take (the step, the loss function, the micro-batches
    as the schedule splits them, the loss scale), and what they leave (each micro-batch's loss, in order)."""

    step: int
    loss_fn: LossFn
    micro_batches: list[Batch]
    loss_scale: float
    losses: list[torch.Tensor] = field(default_factory=list)
    # Set by the last stage's forward: the output and index of the micro-batch whose loss the schedule calls next.
    loss_due: tuple[Any, int] | None = None


class PlanStage(PipelineStage):
    """A stage of the layout: its forwards enter their micro-batch's numerics, its backwards are the numerics'
    when they reduce each micro-batch themselves; when last it tells the run which micro-batch the schedule's
    next loss call is for (the schedule also calls the loss while it sets the stages up, on uninitialised
    outputs, and that call is no micro-batch's)."""

    def __init__(self, *args: Any, numerics: Numerics, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._numerics = numerics
        self._run: _ScheduleRun | None = None
        self._backwards = 0  # of this run

    def begin_run(self, run: _ScheduleRun) -> None:
        self._run, self._backwards = run, 0

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        assert self._run is not None
        self._numerics.enter_micro_batch(self._run.step, fwd_chunk_id)
        output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if self.is_last:
            self._run.loss_due = (output, fwd_chunk_id)
        return output

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        if not (self._numerics.reduces_each_micro_batch and isinstance(self.submod, FSDPModule)):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        assert self._run is not None and backward_type == "full", "the split-backward schedules are refused"
        # Reduce now, as a backward outside pipelining would: FSDP2's hooks run the reduction for this micro-batch.
        self.submod.set_is_last_backward(True)
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        # torch >= 2.15's stage turns on FSDP2's manual backward finalization at every forward, which defers the
        # reduction of a group no backward hook reached (the root's, when the stage's inputs need no gradient)
        # to the schedule's last action; finish it now. Older torch has no such mode (nor the method): its
        # backward callback already reduced every group.
        finalize = getattr(self.submod, "finalize_backward", None)
        if finalize is not None:
            finalize()
        self._backwards += 1
        if self._backwards < len(self._run.micro_batches):
            # The gradients are views of the exchanges' shards: FSDP2 must assign the next ones, not add them.
            # Cleared now, when the backward has resharded every parameter (a root module's stay unsharded
            # from its forward to its backward, and clearing those would leave the sharded ones' views).
            for p in self.submod.parameters():
                p.grad = None
        return grads, None


class StagedLayout(Layout):
    """Stages over the mesh's ``pp`` dimension, FSDP2 over its ``dp_shard`` dimension."""

    def __init__(self, config: JobConfig, world: World) -> None:
        super().__init__(config, world)
        self.pp = config.parallelism.pipeline_parallel_degree
        self.dp = data_parallel_degree(config.parallelism, world.world_size)
        tp = config.parallelism.tensor_parallel_degree
        self.pp_rank, self.dp_rank = divmod(world.rank // tp, self.dp)
        dims = {"pp": self.pp, "dp_shard": self.dp, **({"tp": tp} if tp > 1 else {})}  # no groups of one
        mesh = init_device_mesh(world.device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))
        self.pp_group = mesh["pp"].get_group()
        self.dp_mesh = mesh["dp_shard"]
        self.tensor = TensorDimension(config, mesh, self.pp_rank * self.dp + self.dp_rank)
        # The ranks of this rank's stages: its dp ranks, or with tensor parallelism its dp x tp ranks (one group
        # per stage, every rank creating each, as new_group requires).
        self._stage_group = self.dp_mesh.get_group()
        if tp > 1:
            per_stage = self.dp * tp
            groups = [dist.new_group(list(range(p * per_stage, (p + 1) * per_stage))) for p in range(self.pp)]
            self._stage_group = groups[self.pp_rank]
        self.stages: list[PlanStage] = []
        self.schedule: Any = None
        self.split: PipelineSplit | None = None
        self.stage_ids: list[int] = []  # the stages this rank runs
        self.layers: list[list[int]] = []  # every stage's layers
        self.model_order: list[str] = []  # every trainable parameter of the whole model, by name
        self.model_rows: list[int] = []  # and its rows (its length along dim 0; 1 for a scalar)
        self.names: list[str] = []  # this rank's trainable parameters' names in the unwrapped model
        self._run: _ScheduleRun | None = None

    @classmethod
    def check_config(cls, config: JobConfig, world_size: int, numerics: type[Numerics]) -> None:
        par, training = config.parallelism, config.training
        pp = par.pipeline_parallel_degree
        spec = registered_specs().get(config.model.name)  # first: a model that does not split needs nothing else
        if spec is not None and spec.pipeline is None:
            raise ConfigError(_does_not_split(spec.name, pp))
        numerics.check_stages(par, training)
        numerics.check_data(training, config.data, data_parallel_degree(par, world_size),
                            "data-parallel ranks (processes / (pipeline_parallel_degree x tensor_parallel_degree))"
                            if par.tensor_parallel_degree > 1 else
                            "data-parallel ranks (processes / pipeline_parallel_degree)")
        numerics.check_tensor_parallel(config)
        tensor.check_config(config)
        if training.local_batch_size % numerics.microbatch_size(par, training):
            raise ConfigError(f"config {_KEY}_microbatch_size = {par.pipeline_parallel_microbatch_size} does not "
                              f"divide training.local_batch_size = {training.local_batch_size}; choose a divisor")
        if config.validation.enable:
            raise ConfigError(f"config validation.enable: validation runs the whole model, which {_KEY}_degree "
                              f"= {pp} splits over processes; turn validation off")
        split_starts(config.parallelism)
        count = stage_count(config.parallelism)
        multi = _multi_stage(par.pipeline_parallel_schedule)
        if count % pp or (count != pp and not multi) or (multi and count < 2 * pp):
            per_rank = "one stage" if not multi else "two or more stages"
            raise ConfigError(f"config {_KEY}_schedule = {par.pipeline_parallel_schedule!r} runs {per_rank} per "
                              f"rank, and {count} stages over pipeline_parallel_degree = {pp} do not; set "
                              f"{_KEY}_split_points to name {pp * (2 if multi else 1) - 1} split points")

    @classmethod
    def data_ranks(cls, parallelism: Parallelism, world_size: int) -> int:
        return data_parallel_degree(parallelism, world_size)

    @classmethod
    def compared(cls, values: dict[str, Any], parallelism: Parallelism,
                 blocks: Callable[[], int | None]) -> dict[str, Any]:
        """Split points left to split evenly: the first layers of the stages they make (the same stages named or
        not are the same layout)."""
        if _SPLIT_KEY not in values or parallelism.pipeline_parallel_split_points:
            return values
        n_layers = blocks()
        if n_layers is None:
            return values
        stages = stage_layers(parallelism, n_layers)
        return {**values, _SPLIT_KEY: [f"{_SPLIT_PREFIX}{layers[0]}" for layers in stages[1:]]}

    def describe(self, numerics: Numerics) -> str:
        stages = describe_stages(self.config.parallelism, self.config.training, type(numerics), self.dp, self.layers)
        return f"{stages}; {self.tensor.describe()}" if self.tensor.mesh is not None else stages

    @property
    def data_shard(self) -> tuple[int, int]:
        return self.dp_rank, self.dp

    @property
    def data_group(self) -> dist.ProcessGroup:
        return self.dp_mesh.get_group()

    @property
    def stage_group(self) -> dist.ProcessGroup:
        return self._stage_group

    def wrap(self, model: nn.Module, spec: TrainSpec, numerics: Numerics) -> LossFn:
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.model_order = [name for name, _ in trainable]
        self.model_rows = [p.shape[0] if p.dim() else 1 for _, p in trainable]
        modules = self._split_model(model, spec, numerics)
        numerics.hook_model(model, spec)
        sharded = self.dp > 1
        if sharded:
            for module in modules:
                spec.apply_fsdp(module, self.dp_mesh, numerics.fsdp_policy())
                numerics.sharded(module)
        self.names = [_plain_name(name) for name, p in model.named_parameters() if p.requires_grad]
        self.compute_context = wrapping.autocast_context(self.config.training, self.world.device,
                                                         sharded and numerics.casts_by_fsdp)
        self._build_schedule(modules, numerics)
        return spec.loss_fn

    def _split_model(self, model: nn.Module, spec: TrainSpec, numerics: Numerics) -> list[nn.Module]:
        """Keep this rank's part of ``model`` (checkpointing and compile applied) and return its stages' modules."""
        if spec.pipeline is None or spec.block_lists is None:
            raise ConfigError(_does_not_split(spec.name, self.pp))
        self.split = spec.pipeline
        parallelism = self.config.parallelism
        deeper = self.split.deeper(stage_count(parallelism)) if self.split.deeper else ""
        self.layers = layers = stage_layers(parallelism, len(spec.block_lists(model)[0]), deeper)
        count = len(layers)
        self.stage_ids = stages_of_rank(self.config.parallelism, self.pp_rank)
        self.split.prune(model, {index for s in self.stage_ids for index in layers[s]}, 0 in self.stage_ids,
                         count - 1 in self.stage_ids)
        numerics.split_layers(model, spec, self.tensor)
        wrapping.apply_activation_checkpointing(model, spec, self.config.activation_checkpoint)
        wrapping.apply_compile(model, spec, self.config.compile)
        return [self.split.stage(model, layers[s], s == 0, s == count - 1) for s in self.stage_ids]

    def _splits(self, numerics: Numerics) -> int:
        """Micro-batches a loader batch is split into: its samples over the micro-batch size."""
        training = self.config.training
        return training.local_batch_size // numerics.microbatch_size(self.config.parallelism, training)

    def _pipeline_micro_batches(self, numerics: Numerics) -> int:
        """Micro-batches of one schedule run: each loader batch it takes split by the micro-batch size."""
        return self._splits(numerics) * (numerics.micro_batches_per_rank if numerics.schedule_takes_whole_step else 1)

    def _build_schedule(self, modules: list[nn.Module], numerics: Numerics) -> None:
        """This rank's stages and the configured schedule over them."""
        count = stage_count(self.config.parallelism)
        self.stages = [PlanStage(module, s, count, self.world.device, group=self.pp_group, numerics=numerics)
                       for s, module in zip(self.stage_ids, modules)]
        name = self.config.parallelism.pipeline_parallel_schedule
        schedule = get_schedule_class(name)
        micro_batches = self._pipeline_micro_batches(numerics)
        try:
            # The layout scales the losses itself (by the rank's micro-batches per step): the schedule's own
            # scaling of the gradients after each schedule run would also rescale those accumulated before it.
            self.schedule = schedule(self.stages if issubclass(schedule, PipelineScheduleMulti) else self.stages[0],
                                     n_microbatches=micro_batches, loss_fn=self._micro_batch_loss, scale_grads=False)
        except ValueError as err:  # the schedule's own check of its micro-batches against the stages
            raise ConfigError(f"config {_KEY}_schedule = {name!r} cannot run {micro_batches} micro-batches per "
                              f"schedule run over {count} stages ({err}); give each run more micro-batches") from None

    def _micro_batch_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss: the step's loss function on the micro-batch whose output the last stage gave."""
        run = self._run
        assert self.split is not None and run is not None
        due, run.loss_due = run.loss_due, None
        if due is None or due[0] is not output:  # the schedule setting its stages up: only shapes are kept
            return self.split.loss(output, target) / run.loss_scale
        loss = run.loss_fn(_LastStageOutput(output), run.micro_batches[due[1]], self.config.training)
        run.losses.append(loss.detach().float())
        return loss / run.loss_scale

    def _run_schedule(self, batch: Batch, run: _ScheduleRun) -> list[torch.Tensor]:
        """One schedule run over ``batch`` (``run.micro_batches``: its split, as the schedule splits it); the last
        stage's micro-batch losses, in micro-batch order (none on other stages)."""
        assert self.split is not None
        inputs = (batch[self.split.input_key],) if self._holds_first else ()
        target = batch[self.split.target_key] if self.holds_loss else None
        self._run = run
        for stage in self.stages:
            stage.begin_run(run)
        with self.compute_context():
            self.schedule.step(*inputs, target=target, return_outputs=False)
        self._run = None
        assert len(run.losses) == (len(run.micro_batches) if self.holds_loss else 0)
        return run.losses

    @property
    def _holds_first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def holds_loss(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def forward_backward(self, model: nn.Module, params: list[nn.Parameter], batches: Iterator[dict[str, Any]],
                         loss_fn: LossFn, step: int, numerics: Numerics) -> torch.Tensor:
        """The rank's loader batches through the schedule (all in one run, or one run each, as the numerics
        ask), each split as the schedule splits it (``torch.tensor_split`` along the batch)."""
        per_rank, device = numerics.micro_batches_per_rank, self.world.device
        per_run = per_rank if numerics.schedule_takes_whole_step else 1
        splits = self._splits(numerics)
        scale = numerics.loss_scale(per_rank * splits)
        numerics.begin_step(step)
        losses: list[torch.Tensor] = []
        for _ in range(per_rank // per_run):
            loaded = [to_device(next(batches), device) for _ in range(per_run)]
            batch = loaded[0] if per_run == 1 else {key: torch.cat([b[key] for b in loaded]) for key in loaded[0]}
            micro_batches = []
            for one in loaded:
                parts = {key: value.tensor_split(splits) for key, value in one.items()}
                micro_batches += [{key: split[i] for key, split in parts.items()} for i in range(splits)]
            losses += self._run_schedule(batch, _ScheduleRun(step, loss_fn, micro_batches, scale))
        numerics.finish_grads(params)
        return numerics.step_loss(losses, self)

    def share_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """One rank of each pipeline group holds the loss, the others 0: the sum is that loss, unrounded."""
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.pp_group)
        return loss

    def mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean over the last stage's micro-batches and the dp ranks, the same on every rank."""
        total = torch.zeros((), device=self.world.device)
        if self.holds_loss:
            total = torch.stack(losses).mean()
        # Only the last stage's ranks add a loss: the sum over all ranks is the sum over its dp x tp ranks (those
        # of a tensor-parallel group hold the same loss).
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total / (self.dp * self.tensor.degree)

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

    def in_model_order(self, params: list[nn.Parameter], parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every stage's parts (one value per row of its parameter) gathered over the pipeline group and put in
        the whole model's parameter order, by one all-gather of a vector with a place for every parameter's part
        and a flag per parameter that says whether this rank filled it (a parameter two stages hold: the later
        stage's)."""
        assert len(params) == len(self.names), "the trainer steps the model's trainable parameters"
        mine = dict(zip([name for name, p in zip(self.names, params) if p.grad is not None], parts))
        dtype, device = (parts[0].dtype if parts else torch.float64), self.world.device
        flags = torch.tensor([name in mine for name in self.model_order], dtype=dtype, device=device)
        pieces = [mine[name].reshape(rows) if name in mine else torch.zeros(rows, dtype=dtype, device=device)
                  for name, rows in zip(self.model_order, self.model_rows)]
        local = torch.cat([flags, *pieces])
        gathered = torch.empty(self.pp * local.numel(), dtype=dtype, device=device)
        dist.all_gather_into_tensor(gathered, local, group=self.pp_group)
        by_rank = gathered.view(self.pp, -1)
        held = by_rank[:, : len(flags)].cpu().tolist()  # one read of every rank's flags
        ordered, offset = [], len(flags)
        for index, rows in enumerate(self.model_rows):
            holders = [rank for rank in range(self.pp) if held[rank][index]]
            if holders:
                ordered.append(by_rank[holders[-1], offset : offset + rows])
            offset += rows
        return ordered
