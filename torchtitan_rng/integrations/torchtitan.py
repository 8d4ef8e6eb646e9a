"""Exact resume for torchtitan 0.3 (extra ``torchtitan``), as one override: no fork, no patch of torchtitan.

Turn it on with one flag on a stock launch command (docs/torchtitan.md)::

    --override.imports torchtitan_rng.integrations.torchtitan.exact_resume

torchtitan applies the override before it builds its components: the run's ``CheckpointManager`` becomes an
:class:`ExactResumeCheckpointManager`, which is the stock manager plus

* every rank's global streams (Python, NumPy, torch CPU, its accelerator) in every checkpoint, captured at
  the step boundary where torchtitan saves, under a rank-unique key (``torchtitan_rng.rank_{r}``), each
  rank loading only its own (``TrainState``, as this project's trainer stores them);
* their restore at the step boundary *after* ``iter(dataloader)``: torchtitan's loader draws its
  ``_base_seed`` from the global CPU generator when the iterator is created, which ``train()`` does after
  loading the checkpoint. The manager hands the trainer's loader to the loop in a thin wrapper whose
  ``iter()`` creates the iterator, then restores the streams;
* validation under preserved streams (the trainer's validator, wrapped the same way when it is enabled);
* a stop signal (SIGTERM, SIGUSR1): the ranks agree at a step boundary (one CPU all-reduce, read a step
  later), save a full checkpoint at that step, and the loop ends there: the run exits 0;
* a loss log (``loss_log.jsonl`` in ``dump_folder``, this project's format): every step torchtitan logs
  (``metrics.log_freq``), its float32 ``global_avg_loss`` written exactly, by the rank torchtitan reports
  metrics from (under pipeline parallelism, the last stage's), so ``python -m torchtitan_rng.compare_losses``
  reads torchtitan runs; written with or without ``--checkpoint.enable``;
* the run record of this project (``run.json``: every resolved config key and the versions) in every
  checkpoint; a resume whose config differs in a key that can change the losses names each such key in a
  WARNING line (torchtitan's own workflows change keys on purpose, so nothing is refused);
* at each save under tensor parallelism, a check that the ranks of each tensor-parallel group hold the same
  mask streams (``rng.group_mask_streams``), named in a WARNING line when they do not;
* another process count or layout at a resume: the checkpoint's run record holds the layout it was saved
  with (process count and parallel degrees); rank 0 names both in one WARNING line with the rule each rank's
  streams follow (:func:`layout_change`): rank r restores the streams saved by rank r where the checkpoint
  has them, a rank the checkpoint lacks keeps the streams torchtitan seeded at start;
* a checkpoint without streams (saved by stock torchtitan), or a resume told not to load them
  (``--checkpoint.exclude_from_loading torchtitan_rng``), resumes with one WARNING line and fresh streams;
  a checkpoint of the plug-in resumes in stock torchtitan, which does not ask DCP for the extra key.

* with ``--dataloader.num_workers`` > 0, each loader worker's streams (Python, NumPy, torch CPU) in the
  loader's per-worker state (:func:`carry_worker_streams`): a dataset that draws inside its workers (Flux's
  random crop and caption dropout, drawn in ``__iter__``) continues its streams at a resume instead of
  restarting them from the loader's seed; a loader whose workers' state cannot be carried is named.

Data randomness: the stock text loaders draw nothing at random; Flux's dataset draws, in the process that
iterates it (the trainer's, or a loader worker's).

It also provides what torchtitan 0.3.0 calls and torch 2.13 (and older) lacks: ``torch.distributed.set_timeout``
(called after the first step of every process; the stand-in sets each group's timeout through
``ProcessGroup.set_timeout``, which those versions have) and the pipeline schedules' ``step`` with
pre-split micro-batches (:func:`provide_presplit_step`).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, Literal

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.checkpointer import TRAIN_STATE, CheckpointManager
from torchtitan.components.metrics import _get_metrics_rank
from torchtitan.config.override import derive, override
from torchtitan.tools.logging import logger

from torchtitan_rng.checkpoint.layout import rank_key
from torchtitan_rng.checkpoint.run_record import make_record, read_record, write_record
from torchtitan_rng.checkpoint.safe_load import SafeFileSystemReader
from torchtitan_rng.checkpoint.train_state import TrainState
from torchtitan_rng.data.worker_rng import WorkerRNGDataset, WorkerRNGIterableDataset, uses_global_rng
from torchtitan_rng.distributed import StopVote, rank_and_world_size
from torchtitan_rng.integrations import check_tested_version
from torchtitan_rng.loss_log import LossLogWriter, loss_log_path
from torchtitan_rng import signals as checkpoint_signals
from torchtitan_rng.rng import group_mask_streams, preserved_global_rng

check_tested_version("torchtitan")

# The checkpoint part holding every rank's streams (DCP keys ``torchtitan_rng.rank_{r}``).
STREAMS_PART = "torchtitan_rng"


def provide_set_timeout() -> None:
    """torchtitan 0.3.0 calls ``torch.distributed.set_timeout(timeout, group)`` after each process's first
    step; torch releases up to 2.13 do not have it (only ``ProcessGroup.set_timeout``), so every run would
    crash there. Provide it where it is missing, with the same meaning; a torch that has it keeps its own."""
    if hasattr(dist, "set_timeout"):
        return

    def set_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
        (group if group is not None else dist.distributed_c10d._get_default_group()).set_timeout(timeout)

    dist.set_timeout = set_timeout  # type: ignore[attr-defined]


def provide_presplit_step() -> None:
    """torchtitan 0.3.0 runs pipeline parallelism with micro-batches it has split itself:
    ``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)`` (and ``eval`` the same way). torch releases up
    to 2.13 take only whole-batch inputs there, and read those keywords as model inputs (``ValueError: Expecting
    2 arg_mbs but got 1`` at step 1). Where the schedules lack them, ``step`` takes them as torch 2.14 does: the
    schedule runs the given micro-batches, unsplit; a call without them is torch's own. A torch that has
    them keeps its own."""
    import inspect

    from torch.distributed.pipelining import schedules

    for schedule in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        if "arg_mbs" in inspect.signature(schedule.step).parameters:
            continue
        schedule.step = _presplit_step(schedule.step)  # type: ignore[method-assign]


def _presplit_step(whole_batch: Any) -> Any:
    @functools.wraps(whole_batch)  # its signature and docs; ``__wrapped__`` is torch's own
    def step(self: Any, *args: Any, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
             target_mbs: list | None = None, **kwargs: Any) -> Any:
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return whole_batch(self, *args, **kwargs)
        if args or kwargs.get("target") is not None:
            raise TypeError("schedule.step takes whole-batch inputs or micro-batches (arg_mbs, kwarg_mbs, "
                            "target_mbs), not both")
        run = self._step_microbatches

        def given_microbatches(_args: list, _kwargs: list, _targets: list | None, *rest: Any,
                               **options: Any) -> Any:
            return run(arg_mbs, kwarg_mbs, target_mbs, *rest, **options)

        # torch's step does everything around the micro-batches (stage flags, cleared state, merged outputs);
        # with no whole-batch input its split yields empty micro-batches, replaced here by the given ones.
        self._step_microbatches = given_microbatches
        try:
            return whole_batch(self, **kwargs)
        finally:
            del self._step_microbatches

    return step


provide_set_timeout()
provide_presplit_step()


# Config keys (``section.key`` or whole sections, ``section.*``) that cannot change the losses a resume trains:
# where and how often to save or log, timeouts, what runs inside preserved streams, how the config was given.
QUIET_KEYS = ("checkpoint.*", "metrics.*", "profiler.*", "comm.*", "validator.*", "override.*", "dump_folder",
              "debug.print_config", "debug.save_config_file", "training.steps")
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # reprs of functions in the config differ between processes


def config_values(config: Any) -> dict[str, Any]:
    """Every key of a torchtitan config as ``section.key`` (nested: ``a.b.c``), as JSON values."""
    values: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}.")
            else:
                values[prefix + key] = value

    walk(json.loads(_ADDRESS.sub("", json.dumps(config.to_dict(), default=repr))), "")
    return values


# The parallel degrees of torchtitan's ParallelDims, in the order the layout is written.
_DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


def layout_of(parallel_dims: Any) -> dict[str, int]:
    """The resolved layout of a run: its process count and parallel degrees."""
    return {"world_size": parallel_dims.world_size, **{name: getattr(parallel_dims, name) for name in _DEGREES}}


def _processes(count: int) -> str:
    return f"{count} process{'es' if count != 1 else ''}"


def _ranks(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def describe_layout(world_size: int, layout: dict[str, int] | None) -> str:
    """``2 processes (dp_shard 2)``; the degrees that are not 1, or why there are none to name."""
    if layout is None:
        return f"{_processes(world_size)} (layout not recorded)"
    degrees = " x ".join(f"{name} {layout[name]}" for name in _DEGREES if layout.get(name, 1) != 1)
    return f"{_processes(world_size)} ({degrees or 'no parallelism'})"


def layout_change(saved_world: int, saved_layout: dict[str, int] | None, world: int,
                  layout: dict[str, int]) -> str | None:
    """The WARNING line for a resume on another process count or layout, None when both are the same.
    ``saved_world`` counts the ranks whose streams the checkpoint holds; ``saved_layout`` comes from its run
    record (None for a checkpoint saved before the layout was recorded: then only the counts are compared).

    The rule: rank r restores the streams rank r saved, where the checkpoint has them (a stream continues
    rather than replaying the draws of step 1); a rank the checkpoint lacks keeps the streams torchtitan seeded
    at start (from ``debug.seed``), as in a fresh run. Never one rank's streams onto another rank."""
    def degrees(of: dict[str, int] | None) -> dict[str, int] | None:
        return None if of is None else {name: of.get(name, 1) for name in _DEGREES}

    if saved_world == world and (saved_layout is None or degrees(saved_layout) == degrees(layout)):
        return None
    if world <= saved_world:
        rule = f"{_ranks(0, world - 1)} restore{'s' if world == 1 else ''} the streams saved by the rank of the " \
               "same number"
        if world < saved_world:
            rule += f"; the streams saved by {_ranks(world, saved_world - 1)} are not used"
    else:
        new = world - saved_world
        rule = (f"{_ranks(0, saved_world - 1)} restore{'s' if saved_world == 1 else ''} the streams saved by the "
                f"rank of the same number; {_ranks(saved_world, world - 1)}, new, keep{'s' if new == 1 else ''} "
                "the streams torchtitan seeded at start, as in a fresh run")
    return (f"torchtitan_rng: the checkpoint was saved by {describe_layout(saved_world, saved_layout)} and this run "
            f"has {describe_layout(world, layout)}: {rule}; this resume is not exact")


def saved_stream_ranks(keys: Any) -> int:
    """How many ranks' streams a checkpoint holds (DCP keys ``torchtitan_rng.rank_{r}``)."""
    return sum(1 for key in keys if re.fullmatch(rf"{re.escape(STREAMS_PART)}\.rank_\d+", key))


def _horizon_matters(values: dict[str, Any]) -> bool:
    """Whether the learning-rate schedule depends on ``training.steps`` (a decay spread over the run)."""
    return values.get("lr_scheduler.decay_ratio") != 0


# The parallel degrees as configured; where the checkpoint records its resolved layout, the layout's own line
# names a change of them (layout_change), once.
DEGREE_KEYS = tuple(f"parallelism.{name}_degree" for name in (
    "data_parallel_replicate", "data_parallel_shard", "context_parallel", "tensor_parallel", "pipeline_parallel",
    "expert_parallel"))


def config_drift(saved: dict[str, Any], current: dict[str, Any], layout_recorded: bool = False) -> list[str]:
    """One line per key that differs and can change the losses (``QUIET_KEYS`` and keys one side lacks
    are not compared; ``training.steps`` only where the schedule's decay depends on it; the parallel degrees
    only where the checkpoint has no recorded layout)."""
    def quiet(key: str) -> bool:
        return (key in QUIET_KEYS or f"{key.split('.')[0]}.*" in QUIET_KEYS
                or (layout_recorded and key in DEGREE_KEYS))

    lines = [f"{key} = {current[key]!r} but the checkpoint was trained with {saved[key]!r}"
             for key in sorted(set(saved) & set(current)) if not quiet(key) and saved[key] != current[key]]
    steps = "training.steps"
    if saved.get(steps) != current.get(steps) and _horizon_matters(current):
        lines.append(f"{steps} = {current.get(steps)!r} but the checkpoint was trained with {saved.get(steps)!r}, "
                     "and the learning-rate decay is spread over training.steps (stop by signal, or set "
                     "--lr_scheduler.decay_ratio 0, to stop early exactly)")
    return lines


def attach_loss_log(trainer: Any) -> LossLogWriter | None:
    """Record each step torchtitan logs into ``{dump_folder}/loss_log.jsonl``, on the rank torchtitan logs
    metrics from (the one that holds the loss: under pipeline parallelism the other stages log -1.0); None
    on every other rank. The trainer's ``metrics_processor.log`` receives the step's float32
    ``global_avg_loss`` (as a Python float, the same value TensorBoard stores); the instance's method is
    replaced, not the object wrapped, because the trainer assigns the processor's attributes."""
    rank = rank_and_world_size()[0]
    writer_rank = _get_metrics_rank(parallel_dims=trainer.parallel_dims,
                                    pp_schedule=trainer.config.parallelism.pipeline_parallel_schedule)
    if rank != writer_rank:
        return None
    writer = LossLogWriter(loss_log_path(trainer.config.dump_folder))
    processor = trainer.metrics_processor
    log = processor.log

    def log_and_record(step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
                       extra_metrics: dict[str, Any] | None = None) -> Any:
        # llama3's trainer logs "lr/<optimizer>", Flux's "lr".
        lr = next((value for key, value in (extra_metrics or {}).items() if key == "lr" or key.startswith("lr/")),
                  None)
        writer.write({"step": step, "loss": global_avg_loss, "lr": lr, "grad_norm": grad_norm})
        writer.flush()  # host floats already: no device sync; fsynced, so a kill loses no logged step
        return log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)

    processor.log = log_and_record
    return writer


def carry_worker_streams(loader: Any, carry: bool = True) -> str | None:
    """Let each of ``loader``'s workers carry its streams across a resume; the WARNING line where they are not.

    A StatefulDataLoader saves each worker's dataset state, taken inside the worker after each batch, and hands
    it back to the same worker at a resume, after the worker has seeded its streams from the loader's seed: the
    dataset, wrapped (``WorkerRNGIterableDataset``, or ``WorkerRNGDataset`` for a map-style one), puts the
    worker's streams into that state and back. Nothing to do without workers (the dataset draws from the
    training streams) or for a dataset that derives its randomness per sample."""
    workers = getattr(loader, "num_workers", 0)
    dataset = getattr(loader, "dataset", None)
    if workers == 0 or dataset is None or not uses_global_rng(dataset):
        return None
    why = (f"the dataloader ({type(loader).__name__}) is not a torchdata StatefulDataLoader, which saves its "
           "workers' state" if not isinstance(loader, StatefulDataLoader) else
           "worker_streams is off" if not carry else None)
    if why is not None:
        return (f"torchtitan_rng: the dataloader runs {workers} worker{'s' if workers != 1 else ''} and {why}: "
                "what its dataset draws at random inside a worker restarts from the loader's seed at a resume, "
                "so a resume is not exact if it draws")
    wrapped = WorkerRNGIterableDataset(dataset) if isinstance(dataset, IterableDataset) else WorkerRNGDataset(dataset)
    # DataLoader refuses a new dataset once built; nothing has iterated it yet, and the wrapper is of the same
    # kind (iterable or map-style), the one thing the loader derived from it.
    object.__setattr__(loader, "dataset", wrapped)
    return None


class _RestoreAfterIter:
    """The trainer's dataloader as the training loop sees it: ``iter()`` creates the loader's iterator,
    then puts back the loaded streams (the step boundary, nothing of the resumed step has drawn yet)."""

    def __init__(self, loader: Any, manager: ExactResumeCheckpointManager) -> None:
        self._loader = loader
        self._manager = manager

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self._loader)
        self._manager.restore_streams()
        return iterator

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _PreservedStreamsValidator:
    """The trainer's validator, whose ``validate`` leaves every training stream where it found it."""

    def __init__(self, validator: Any, device: torch.device) -> None:
        self._validator = validator
        self._device = device

    def validate(self, *args: Any, **kwargs: Any) -> Any:
        with preserved_global_rng(self._device):
            return self._validator.validate(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._validator, name)


class ExactResumeCheckpointManager(CheckpointManager):
    """torchtitan's DCP checkpoint manager, with every rank's streams and a save-and-stop on signals."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        signals: list[str] = field(default_factory=lambda: list(checkpoint_signals.DEFAULT_SIGNALS))
        """Signals that save a full checkpoint at an agreed step and end the run (exit 0)."""

        restore_streams_at: Literal["first_iter", "load"] = "first_iter"
        """``first_iter``: after ``iter(dataloader)`` (exact). ``load``: inside the checkpoint load, one
        ``_base_seed`` draw too early; there only to show that the restore point matters."""

        worker_streams: bool = True
        """Carry each loader worker's streams in the loader's per-worker state (``--dataloader.num_workers``
        > 0). ``False`` leaves them to the loader's seed (named at start); only to show that they matter."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.restore_streams_at not in ("first_iter", "load"):
                raise ValueError(f"torchtitan_rng: restore_streams_at = {self.restore_streams_at!r}; use "
                                 "\"first_iter\" (exact) or \"load\"")
            checkpoint_signals.signal_numbers(self.signals)  # one line naming a signal that cannot be caught

    def __init__(self, config: Config, **kwargs: Any) -> None:
        # The trainer has built its metrics processor; the loss log is written with checkpoints off too.
        self.loss_log = attach_loss_log(kwargs["states"][TRAIN_STATE])
        super().__init__(config, **kwargs)
        if not self.enable:
            if rank_and_world_size()[0] == 0:
                logger.warning("torchtitan_rng: checkpointing is off (--checkpoint.enable): no random "
                               "streams are saved and stop signals are not handled")
            return
        self.restore_streams_at = config.restore_streams_at
        self.trainer = self.states[TRAIN_STATE]
        self.streams = TrainState(self.trainer.device)
        self.states[STREAMS_PART] = self.streams
        self._restore_pending = False
        self._stop_step: int | None = None
        checkpoint_signals.install(config.signals)
        self.vote: StopVote | None = StopVote()  # a collective: every rank builds its manager here
        dims = self.trainer.parallel_dims
        self._tp_group = dims.get_mesh("tp").get_group() if dims.tp_enabled else None
        line = carry_worker_streams(self.trainer.dataloader, config.worker_streams)
        if line is not None and self.streams.rank == 0:
            logger.warning(line)
        # The loop iterates trainer.dataloader; the checkpoint keeps the loader itself (states["dataloader"]).
        self.trainer.dataloader = _RestoreAfterIter(self.trainer.dataloader, self)

    def load(self, step: int = -1) -> bool:
        """The stock load (the first thing ``train()`` does); the streams go back at ``iter(dataloader)``."""
        if not self.enable:
            return False
        validator = getattr(self.trainer, "validator", None)  # built after this manager
        if validator is not None and not isinstance(validator, _PreservedStreamsValidator):
            self.trainer.validator = _PreservedStreamsValidator(validator, self.trainer.device)
        self.streams.loaded = None
        loaded = self._load(step)
        self._restore_pending = self.streams.loaded is not None
        if self.restore_streams_at == "load":
            self.restore_streams()
        return loaded

    def restore_streams(self) -> None:
        """Put this rank's loaded streams back (once); the device's only when saved from the same device type."""
        if not self._restore_pending:
            return
        self._restore_pending = False
        saved_device = self.streams.loaded["device_type"]
        same_device = saved_device == self.trainer.device.type
        if not same_device and rank_and_world_size()[0] == 0:
            logger.warning(f"torchtitan_rng: the checkpoint's streams were saved on {saved_device} and this run "
                           f"trains on {self.trainer.device.type}: the device stream starts fresh, so the resume "
                           "is not exact")
        self.streams.restore_rng(include_device=same_device)

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                 from_quantized: bool) -> None:
        if STREAMS_PART in self.exclude_from_loading and not from_hf and self.streams.rank == 0:
            logger.warning(f"torchtitan_rng: --checkpoint.exclude_from_loading names {STREAMS_PART}: every rank "
                           "resumes with the streams torchtitan seeded at start, so this resume is not exact")
        if STREAMS_PART in state_dict and not from_hf:
            record = read_record(Path(checkpoint_id)) if self.streams.rank == 0 else None
            keys = SafeFileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
            saved = saved_stream_ranks(keys)
            if self.streams.rank == 0:  # before the load: torchtitan's dataloader may refuse another dp degree
                self._check_drift(record)
                saved_layout = (record or {}).get("layout")
                saved_layout = saved_layout if isinstance(saved_layout, dict) else None  # older: not recorded
                line = (layout_change(saved, saved_layout, self.streams.world_size,
                                      layout_of(self.trainer.parallel_dims)) if saved else
                        f"torchtitan_rng: checkpoint {checkpoint_id} holds no random streams (saved without "
                        "torchtitan_rng): resuming with fresh random streams, so this resume is not exact")
                if line is not None:
                    logger.warning(line)
            if f"{STREAMS_PART}.{rank_key(self.streams.rank)}" not in keys:
                # DCP raises on a key the checkpoint lacks: this rank loads without streams (named above).
                state_dict = {name: part for name, part in state_dict.items() if name != STREAMS_PART}
        super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)

    def _check_drift(self, saved: dict[str, Any] | None) -> None:
        """Name every changed key that can change the losses (a checkpoint without a record has none)."""
        if saved is None:
            return
        layout_recorded = isinstance(saved.get("layout"), dict)
        for line in config_drift(saved["config"], config_values(self.trainer.config), layout_recorded):
            logger.warning(f"torchtitan_rng: {line}: this resume is no longer the run that was stopped")

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        return curr_step == self._stop_step or super()._should_save(curr_step, last_step)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Called after every step: the stock save, or on an agreed stop signal a full save and the end."""
        self.streams.step = curr_step
        assert self.vote is not None
        if not self.vote.poll(checkpoint_signals.received() is not None):
            if self._should_save(curr_step, last_step):
                self._check_tensor_parallel_streams(curr_step)
            self._write_record(curr_step, last_step)
            return super()._save(curr_step, last_step)
        self._stop_step = curr_step
        self._check_tensor_parallel_streams(curr_step)
        self._write_record(curr_step, False)
        saved = super()._save(curr_step, last_step=False)  # last_step would save the model only by default
        self.maybe_wait_for_saving()
        logger.info(f"torchtitan_rng: stop signal: saved a full checkpoint at step {curr_step}; stopping")
        self.trainer.config.training.steps = curr_step  # the loop ends after this step
        return saved

    def _check_tensor_parallel_streams(self, step: int) -> None:
        """At a save, every rank of a tensor-parallel group: compare the group's mask streams (one gather of
        their fingerprints); the group's first rank names a difference."""
        if self._tp_group is None:
            return
        ranks, line = group_mask_streams(step, self._tp_group, self.trainer.device)
        if self.streams.rank != ranks[0]:
            return
        if line is not None:
            logger.warning(f"torchtitan_rng: {line}")
        else:
            logger.info(f"torchtitan_rng: step {step}: the mask streams of tensor-parallel ranks "
                        f"{', '.join(map(str, ranks))} are equal")

    def _write_record(self, step: int, last_step: bool) -> None:
        """Rank 0 puts the run record into the folder of a checkpoint about to be saved (before DCP writes
        ``.metadata``, which is what makes torchtitan count the folder as a checkpoint)."""
        if self.streams.rank != 0 or not self._should_save(step, last_step):
            return
        folder = Path(self._create_checkpoint_id(step))
        folder.mkdir(parents=True, exist_ok=True)
        record = make_record(config_values(self.trainer.config), None)
        record["layout"] = layout_of(self.trainer.parallel_dims)  # named at a resume on another layout
        write_record(folder, record)

    def _close(self) -> None:
        if getattr(self, "vote", None) is not None:
            self.vote.close()  # every rank has one vote in flight; finish it before the group goes
            self.vote = None
        if getattr(self, "loss_log", None) is not None:
            self.loss_log.close()
            self.loss_log = None
        super()._close()


@override(target=CheckpointManager.Config, exact=True,
          description="torchtitan_rng: every rank's random streams in the checkpoint, restored after "
                      "iter(dataloader); validation under preserved streams; save-and-stop on signals")
def exact_resume(config: CheckpointManager.Config, **options: Any) -> ExactResumeCheckpointManager.Config:
    """The override: the run's checkpoint settings, on :class:`ExactResumeCheckpointManager`. ``options``
    (``signals``, ``restore_streams_at``, ``worker_streams``) come from
    ``--override.imports 'TARGET={"signals": [...]}'``."""
    return derive(config, ExactResumeCheckpointManager.Config, **options)
