"""How a training step is split over processes: one plan per run, composed from a layout and a numerics.

The plan is chosen once from the config (:func:`mode_of` reads which layout and which numerics it asks for;
nothing else reads the mode); the trainer, the resume, the launcher's preflight, the sample listing and the
diagnosis ask the plan (or, before any process starts, its :class:`Mode`). A plan owns:

* what a process must fix before it computes (kernels, threads: :meth:`ParallelPlan.prepare_process`);
* how parameters are wrapped (activation checkpointing, compile, sharding, stages) and the compute context
  (:meth:`ParallelPlan.wrap`);
* which micro-batches a rank runs (:meth:`ParallelPlan.batch_sampler`, :attr:`ParallelPlan.micro_batches_per_rank`),
  their numbering in the step (:meth:`ParallelPlan.slot`) and how many samples a step takes
  (:attr:`ParallelPlan.samples_per_step`);
* how a step's gradients are reduced and what loss it reports (:meth:`ParallelPlan.forward_backward`), and the norm
  they are clipped by (:meth:`ParallelPlan.clip_grad_norm`);
* which ranks read the same batches (:attr:`ParallelPlan.data_shard`) and hold the same streams
  (:attr:`ParallelPlan.stream_rank`, :attr:`ParallelPlan.tensor_group`);
* which streams enter a step (:attr:`ParallelPlan.carries_streams`, :meth:`ParallelPlan.step_streams`,
  :meth:`ParallelPlan.data_position`);
* what the checkpoint records about the mode (``mode.py``), what a checkpoint of another layout or process count
  means (:meth:`Mode.check_checkpoint`, :meth:`Mode.layout_keys`), and where the data stands after a resume
  (:meth:`ParallelPlan.position_data`).

The two axes: the **layout** (``layout.py``: which ranks hold which stages and data shards, micro-batches per rank,
the mesh; :class:`~.layout.FlatLayout` without stages, :class:`~.pipeline.StagedLayout` with them, each with a
tensor-parallel dimension, ``tensor.py``) and the
**numerics** (``numerics.py``: carried streams and FSDP2's reduce-scatter; ``invariant/numerics.py``: streams
derived per micro-batch and block, the slot-order exchange, fixed kernels). Any layout with any numerics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn
from torch.utils.data import Dataset

from torchtitan_rng.checkpoint.layout import CheckpointInfo
from torchtitan_rng.checkpoint.states import Stateful
from torchtitan_rng.config import JobConfig, Parallelism, Training, from_values
from torchtitan_rng.distributed import World
from torchtitan_rng.parallel.invariant.numerics import DerivedNumerics
from torchtitan_rng.parallel.layout import MICROBATCH_KEY, FlatLayout, Layout
from torchtitan_rng.parallel.numerics import CarriedNumerics, Numerics
from torchtitan_rng.train_spec import LossFn, TrainSpec


@dataclass(frozen=True)
class Mode:
    """A layout and a numerics, before any process starts: what the launcher, the resume's vetting, the replay and
    the sample listing ask of a config."""

    layout: type[Layout]
    numerics: type[Numerics]
    tensor_parallel_degree: int = 1

    def check_config(self, config: JobConfig, world_size: int) -> None:
        """Raise ConfigError when ``world_size`` processes cannot run this config in this mode."""
        self.layout.check_config(config, world_size, self.numerics)

    def check_checkpoint(self, info: CheckpointInfo, world_size: int | None, on_world_size_change: str | None) -> bool:
        """Whether this mode can continue ``info`` with ``world_size`` processes (None: not known yet): raises
        CheckpointError when it cannot, returns True when it goes on inexactly with reseeded streams and data
        (the process count changed and ``on_world_size_change="reseed"`` allows it; None: no such option is
        offered, as by a layout whose data split is not the process count), False for an exact resume."""
        offered = on_world_size_change if self.layout.reseeds_by_process_count else None
        return self.numerics.check_checkpoint(info, world_size, offered, self.tensor_parallel_degree)

    def layout_keys(self) -> tuple[str, ...]:
        """Config keys that only lay a step out over processes, this mode giving the same bits whatever their
        value: a resume may change them without a word (the run record does not compare them)."""
        return self.numerics.layout_keys()

    def resolved(self, parallelism: Parallelism, training: Training) -> dict[str, Any]:
        """The keys whose unset value (their default) this mode resolves, at the value it runs (``section.key``:
        the run record holds these)."""
        return {MICROBATCH_KEY: self.numerics.microbatch_size(parallelism, training)}

    def compared(self, values: dict[str, Any], blocks: Callable[[], int | None]) -> dict[str, Any]:
        """``values`` (a run record's config) as a resume in this mode compares them: without the
        :meth:`layout_keys`, and with the pipeline keys of the layout ``values`` itself asks for as it lays the
        model out (none without stages, where they mean nothing; the split points as the stages' first layers, of
        the model's ``blocks()`` when they were left to split evenly), so that the layout is compared, not its
        spelling."""
        parallelism = from_values(values).parallelism
        kept = {key: value for key, value in values.items() if key not in self.layout_keys()}
        return mode_of(parallelism).layout.compared(kept, parallelism, blocks)

    def step_sample_keys(self, config: JobConfig, num_samples: int, world_size: int, step: int) -> list[list[int]]:
        """The sample keys of each micro-batch of ``step`` of a map-style run of ``world_size`` processes over
        ``num_samples`` samples per epoch, in slot order (:meth:`ParallelPlan.slot`, as ``metrics.log_samples``
        writes them), from the config alone."""
        shards = self.layout.data_ranks(config.parallelism, world_size)
        return self.numerics.step_sample_keys(config, num_samples, shards, step)

    @property
    def any_process_count(self) -> bool:
        """Whether a run's samples, streams and sums are the same at every process count its step divides."""
        return self.numerics.any_process_count


def mode_of(parallelism: Parallelism) -> Mode:
    """The mode ``parallelism`` asks for: the one place that reads it."""
    numerics = DerivedNumerics if parallelism.world_size_invariant else CarriedNumerics
    tp = parallelism.tensor_parallel_degree
    if parallelism.pipeline_parallel_degree > 1:
        # Imported only here: torch.distributed.pipelining pulls in torch._dynamo, ~0.6 s of CPU that the
        # launcher of a run that does not pipeline need not spend.
        from torchtitan_rng.parallel.pipeline import StagedLayout

        return Mode(StagedLayout, numerics, tp)
    return Mode(FlatLayout, numerics, tp)


class ParallelPlan:
    """How one run's steps are split over its processes; built once, after the process group."""

    def __init__(self, config: JobConfig, world: World) -> None:
        self.config = config
        self.world = world
        self.mode = mode_of(config.parallelism)
        self.mode.check_config(config, world.world_size)
        self.layout = self.mode.layout(config, world)
        self.numerics = self.mode.numerics(config, self.layout.data_shard, world.device)

    def prepare_process(self) -> None:
        """Process-wide settings every computation of the run depends on (kernels, threads)."""
        self.numerics.prepare_process()

    def describe(self) -> str:
        """The layout in one line for the run's banner, after :meth:`wrap` ("": nothing beyond the process count)."""
        return self.layout.describe(self.numerics)

    # --- building ----------------------------------------------------------------------------------------
    def wrap(self, model: nn.Module, spec: TrainSpec) -> LossFn:
        """Wrap the built model in place (checkpointing, compile, sharding, stages), set the layout's compute
        context, and return the loss function to train with (compiled when asked)."""
        return self.layout.wrap(model, spec, self.numerics)

    @property
    def micro_batches_per_rank(self) -> int:
        """Batches a rank takes from its loader per optimizer step."""
        return self.numerics.micro_batches_per_rank

    @property
    def samples_per_step(self) -> int:
        """Samples one optimizer step trains on, over all ranks."""
        return self.numerics.samples_per_step

    def slot(self, shard: int, index: int) -> int:
        """The number of data shard ``shard``'s loader batch ``index`` of a step among the step's loader batches: the
        one numbering of micro-batches of the loss log's samples, ``samples`` and ``replay``. Shard-major in the
        ordinary mode; in the world-size-invariant mode the slot the mode deals it (round by round over the shards),
        the same at any process count. The ranks of one shard (a pipeline's stages) load the same batches: they
        have one number."""
        return self.numerics.slot(shard, index)

    def batch_sampler(self, dataset: Dataset) -> Any:
        """The batch sampler of this rank's loader; None: the loader's own per-rank sampler. Raises ConfigError
        when the dataset cannot be split this way."""
        return self.numerics.batch_sampler(dataset)

    def record_parts(self) -> dict[str, Stateful]:
        """Checkpoint parts that record this mode (checked again when loaded)."""
        return self.numerics.record_parts()

    # --- a step ------------------------------------------------------------------------------------------
    def forward_backward(self, model: nn.Module, params: list[nn.Parameter], batches: Iterator[dict[str, Any]],
                         loss_fn: LossFn, step: int) -> torch.Tensor:
        """Run this rank's micro-batches of ``step``, each loss by ``loss_fn``, leave the step's gradients in
        ``p.grad`` (reduced over the ranks), and return the step's loss as logged (the same value on every
        rank)."""
        return self.layout.forward_backward(model, params, batches, loss_fn, step, self.numerics)

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip this rank's gradients by the total norm of the whole model's (``max_norm`` 0: off) and return
        that norm as a 0-d tensor on the device (the loss log reads it later)."""
        return self.numerics.clip_grad_norm(params, max_norm, self.layout)

    @property
    def data_shard(self) -> tuple[int, int]:
        """(this rank's share, the number of shares) of the data: ranks of one share read the same batches."""
        return self.layout.data_shard

    @property
    def stream_rank(self) -> int:
        """What seeds this rank's global streams in a fresh or reseeded run: its data shard and stage, the same on
        every rank of a tensor-parallel group (the process rank without tensor parallelism)."""
        return self.layout.stream_rank

    @property
    def tensor_group(self) -> Any:
        """The ranks that split this rank's layers with it (None: no tensor parallelism): their streams must
        agree."""
        return self.layout.tensor_group

    # --- streams and data position -----------------------------------------------------------------------
    @property
    def carries_streams(self) -> bool:
        """True when the global streams go on from step to step (saved and restored with the checkpoint);
        False when each step seeds them itself."""
        return self.numerics.carries_streams

    def step_streams(self, step: int) -> ContextManager:
        """Within it, the global streams stand as the first micro-batch of ``step`` on this rank will draw them
        (for fingerprints); no stream of the run moves. Carried streams already stand so."""
        return self.numerics.step_streams(step)

    def data_position(self, dataloader: Any) -> Stateful:
        """What carries this rank's data position across a resume (fingerprinted as the "dataloader" stream)."""
        return self.numerics.data_position(dataloader)

    def position_data(self, sampler: Any, step: int, saved_data_ranks: int | None, reseeded: bool) -> None:
        """After a checkpoint of ``step`` was loaded: put the data where ``step`` leaves it, when the loader's
        own state was not loaded (another process count, or a mode that does not restore it); ``saved_data_ranks``:
        the data shards of the run that saved it (None: not known)."""
        self.numerics.position_data(sampler, step, saved_data_ranks, reseeded)

    @property
    def loads_dataloader(self) -> bool:
        """Whether a resume loads the loader's saved state (else :meth:`position_data` sets its position)."""
        return self.numerics.loads_dataloader
