"""A run's parts built from its config, in torchtitan's order, with no lock, process group or resume of its own:
the parallel plan, the model (identical initial weights on every rank, then wrapped by the plan), optimizer,
lr schedule, dataset and its loader, and the train state. The trainer builds with it; so do the benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from torchtitan_rng.checkpoint.states import Stateful, checkpoint_parts
from torchtitan_rng.checkpoint.train_state import TrainState
from torchtitan_rng.config import JobConfig, parse_spike_guard, snapshot_every_n_steps
from torchtitan_rng.data.dataloader import ResumableDataLoader, map_style_problem
from torchtitan_rng.data.sample_keys import with_sample_keys
from torchtitan_rng.data.streaming import StreamingDataLoader, WindowStream
from torchtitan_rng.data.worker_rng import with_worker_rng
from torchtitan_rng.distributed import World
from torchtitan_rng.errors import ConfigError
from torchtitan_rng.fault_injection import held_samples
from torchtitan_rng.lr_scheduler import build_lr_scheduler
from torchtitan_rng.models import get_train_spec
from torchtitan_rng.optimizer import build_optimizer
from torchtitan_rng.parallel.plan import ParallelPlan
from torchtitan_rng.rng import seed_model_init
from torchtitan_rng.spike_guard import SpikeGuard
from torchtitan_rng.train_spec import LossFn, TrainSpec


@dataclass
class Components:
    """Everything a step and a checkpoint use, built and wrapped, not yet resumed."""

    spec: TrainSpec
    plan: ParallelPlan
    model: nn.Module
    param_count: int  # before wrapping: what the model is, not how it is held
    params: list[nn.Parameter]  # the trainable ones, which the optimizer steps
    loss_fn: LossFn
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    dataset: Dataset
    dataloader: ResumableDataLoader | StreamingDataLoader
    train_state: TrainState
    spike_guard: SpikeGuard | None  # training.spike_guard: its window is checkpointed

    def checkpoint_parts(self) -> dict[str, Stateful]:
        """What a checkpoint of this run holds (``checkpoint/states.py``), the plan's layout record included."""
        return checkpoint_parts(model=self.model, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                                dataloader=self.dataloader, train_state=self.train_state,
                                extras={**self.plan.record_parts(),
                                        **({SpikeGuard.PART: self.spike_guard} if self.spike_guard else {})} or None)


def build_components(config: JobConfig, world: World) -> Components:
    plan = ParallelPlan(config, world)
    plan.prepare_process()
    spec = get_train_spec(config)
    # Identical initial weights on every rank (a shared stream), then wrapped (and sharded) by the plan.
    seed_model_init(config.debug.seed)
    model = spec.build_model(config).to(world.device)
    param_count = sum(p.numel() for p in model.parameters())
    loss_fn = plan.wrap(model, spec)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, config.optimizer)
    lr_scheduler = build_lr_scheduler(optimizer, config)
    dataset = spec.build_dataset(config)
    dataloader = build_dataloader(config, world, plan, dataset)
    rule = parse_spike_guard(config.training.spike_guard)
    return Components(spec, plan, model, param_count, params, loss_fn, optimizer, lr_scheduler, dataset, dataloader,
                      TrainState(world.device, world.rank, world.world_size, plan.tensor_group),
                      SpikeGuard(rule, world.device) if rule is not None else None)


def build_dataloader(config: JobConfig, world: World, plan: ParallelPlan,
                     dataset: Dataset) -> ResumableDataLoader | StreamingDataLoader:
    """This rank's loader over ``dataset``: a streaming source's, or the map-style one with the plan's sampler."""
    if not isinstance(dataset, WindowStream) and (problem := map_style_problem(dataset)):
        raise ConfigError(f"model {config.model.name!r} (build_dataset of its TrainSpec): {problem}")
    data = config.data
    dp_rank, dp_world = plan.data_shard
    loader_args = {"batch_size": config.training.local_batch_size, "dp_rank": dp_rank, "dp_world": dp_world,
                   "seed": config.debug.seed, "num_workers": data.num_workers, "prefetch_factor": data.prefetch_factor,
                   # The loader counts micro-batches: the user's cadence is in optimizer steps.
                   "snapshot_every_n_steps": snapshot_every_n_steps(config) * plan.micro_batches_per_rank}
    if isinstance(dataset, WindowStream):  # data.streaming: file position and shuffle buffers are saved
        if config.metrics.log_samples:
            raise ConfigError("config metrics.log_samples records the keys of a map-style dataset's samples, and a "
                              "streaming source (data.streaming) has none; turn one of them off")
        return StreamingDataLoader(dataset, **loader_args)
    if data.streaming:
        raise ConfigError(f"config data.streaming: model {config.model.name!r} has no streaming source")
    # Form 2: a dataset that may use the global RNGs in workers gets them carried across a resume.
    keyed = with_sample_keys(dataset) if config.metrics.log_samples else dataset
    keyed = held_samples(keyed, world.rank)  # itself unless a test arms data_loading
    return ResumableDataLoader(with_worker_rng(keyed, data.capture_worker_rng), **loader_args,
                               on_num_workers_change=data.on_num_workers_change,
                               batch_sampler=plan.batch_sampler(dataset))
