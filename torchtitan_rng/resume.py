"""The trainer's resume policy: which checkpoint a run starts from, what this run is recorded as, and how its
random streams and data start at the first resumed step.

The checkpoint is vetted once (``checkpoint/vetting.py``: whole, layout, files, record) before anything is
loaded; the run's parallel plan says what a checkpoint of another layout or process count means and where
the data stands after the load. When the checkpoint does not fit the run exactly:

* Another number of processes: refused in one line, unless the run's plan continues it exactly at any count
  itself (``parallel/``), or ``checkpoint.on_world_size_change = "reseed"`` asks to go on inexactly: DCP reshards
  model and optimizer; no saved per-rank stream is used (rank r of M processes has no counterpart among N);
  every rank's global streams are reseeded from ``(seed, "reseed", step, rank)``; the plan repositions the data.
* Another device type (saved on CUDA, resumed on the CPU, or the reverse): the device generator's state has
  another format. Refused, unless ``checkpoint.allow_device_type_change``: then the device stream is reseeded
  as above and the CPU, NumPy and Python streams are restored.
* No RNG state (a checkpoint from an older version or another tool): a WARNING and reseeded streams;
  ``checkpoint.strict_rng`` makes it an error.

Every decision is taken from the checkpoint's metadata and the config, so all ranks take the same one.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from torchtitan_rng import skips
from torchtitan_rng.checkpoint import integrity, layout, owner, run_record
from torchtitan_rng.checkpoint.manager import CheckpointManager, saves_at
from torchtitan_rng.checkpoint.storage import Location, Where, checkpoint_folder, locate
from torchtitan_rng.checkpoint.train_state import TrainState
from torchtitan_rng.checkpoint.vetting import Vetted, vet
from torchtitan_rng.config import Checkpoint, JobConfig, Training, lr_total_steps, to_dict
from torchtitan_rng.errors import CheckpointError, ConfigError
from torchtitan_rng.models import get_train_spec
from torchtitan_rng.parallel import mode_of
from torchtitan_rng.parallel.plan import ParallelPlan
from torchtitan_rng.parallel.tensor import KEY as TENSOR_KEY, saved_data_ranks, saved_tensor_degree
from torchtitan_rng.rng import seed_training_streams, stream_seed

# Bytes hashed at each end of a dataset file: cheap on any size, and a changed file almost always differs in
# size or at one end.
_HASHED_END_BYTES = 1 << 20


# --- what this run is recorded as (run.json) ----------------------------------------------------------------
def _file_fingerprint(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    digest = hashlib.blake2b(digest_size=16)
    with path.open("rb") as file:
        digest.update(file.read(_HASHED_END_BYTES))
        if size > _HASHED_END_BYTES:
            file.seek(max(_HASHED_END_BYTES, size - _HASHED_END_BYTES))
            digest.update(file.read())
    return {"bytes": size, "blake2b_ends": digest.hexdigest()}


def data_fingerprint(training: Training, dataset: Any) -> dict[str, Any]:
    """The data a run trains on: the dataset file's size and a hash of its ends (when it is a file) and the
    number of samples per epoch. The vocabulary follows from the data and model.vocab_size (compared as a key)."""
    # A stream (an IterableDataset) has no length: its file's fingerprint stands for it.
    fingerprint: dict[str, Any] = {"samples": len(dataset)} if hasattr(dataset, "__len__") else {}
    path = Path(training.dataset_path)
    if training.dataset_path and path.is_file():
        fingerprint.update(_file_fingerprint(path))
    return fingerprint


def resolved(config: JobConfig) -> dict[str, Any]:
    """Every key as ``section.key``, with the lr horizon resolved (0 means training.steps) and what the parallel
    mode resolves (an unset pipeline micro-batch size)."""
    values = {f"{section}.{key}": value for section, keys in to_dict(config).items() for key, value in keys.items()}
    values[run_record.HORIZON_KEY] = lr_total_steps(config)
    values.update(mode_of(config.parallelism).resolved(config.parallelism, config.training))
    values[skips.KEY] = skips.canonical(config.training.skip_steps)
    return values


def build_record(config: JobConfig, dataset: Any) -> dict[str, Any]:
    record = run_record.make_record(resolved(config), data_fingerprint(config.training, dataset))
    record[WRITTEN_BY] = _dump_folder(config)
    return record


# The record's key for the dump folder of the run that wrote a checkpoint (absolute): a checkpoint folder that
# two dump folders share (a URL prefix, an absolute folder) holds checkpoints of either.
WRITTEN_BY = "dump_folder"
_WRITTEN_BY_KEY = "job.dump_folder"  # what checkpoint.allow_config_change names to resume another's checkpoints


def _dump_folder(config: JobConfig) -> str:
    return str(Path(config.job.dump_folder).resolve())


def owner_of(config: JobConfig) -> str:
    """What this run's checkpoint folder records as its owner (checkpoint/owner.py): its dump folder."""
    return _dump_folder(config)


def _moved(folder: Location, saved: str, dump: Path) -> str:
    return (f"checkpoint folder {folder} belongs to the run of dump folder {saved}, which no longer exists: if this "
            f"dump folder ({dump}) is that run, moved, pass --checkpoint.allow_config_change {_WRITTEN_BY_KEY} to "
            "go on from its checkpoints here; otherwise give this run its own --checkpoint.folder")


def _judge_owner(config: JobConfig, folder: Location, holder: str | None) -> list[str]:
    """Whether this run may save into ``folder``, which belongs to the run of dump folder ``holder``: refused
    when that is another run (alive, or moved), a WARNING where checkpoint.allow_config_change hands it over."""
    dump = Path(_dump_folder(config))
    if holder is None or holder == str(dump) or owner.moves_with(folder, dump):
        return []
    if _WRITTEN_BY_KEY in config.checkpoint.allow_config_change:
        return [f"WARNING: checkpoint folder {folder} belonged to the run of dump folder {holder}; it belongs to "
                f"this one ({dump}) from now on, as checkpoint.allow_config_change allows {_WRITTEN_BY_KEY}"]
    if not Path(holder).exists():
        raise CheckpointError(_moved(folder, holder, dump))
    raise CheckpointError(f"checkpoint folder {folder} belongs to the run of dump folder {holder} (its "
                          f"{owner.OWNER_NAME}), not this one ({dump}): two runs saving into one folder write over "
                          "each other's checkpoints; give this run its own --checkpoint.folder, or resume that run "
                          f"with --job.dump_folder {holder}")


def _refuse_inside_a_checkpoint(folder: Location) -> None:
    inside = layout.enclosing_checkpoint(folder)
    if inside is not None:
        where = "is" if inside == folder else "is inside"
        raise CheckpointError(f"checkpoint folder {folder} {where} the complete checkpoint {inside}: this run's steps "
                              "would be written into that checkpoint; pass the folder that holds checkpoints, not "
                              f"one of them (or --checkpoint.initial_load_path {inside} to start from it)")


def check_owner(config: JobConfig) -> None:
    """Refuse, before a run starts, a checkpoint folder that belongs to another run, or lies inside a checkpoint
    (nothing is written)."""
    if config.checkpoint.enable:
        folder = folder_of(config)
        _refuse_inside_a_checkpoint(folder)
        _judge_owner(config, folder, owner.owner_of(folder))


def claim_folder(config: JobConfig) -> list[str]:
    """Make the checkpoint folder this run's before its first save (the launcher, or rank 0 without one), or
    refuse; returns the WARNING of a folder handed over (checkpoint.allow_config_change job.dump_folder)."""
    if not config.checkpoint.enable:
        return []
    folder, dump = folder_of(config), _dump_folder(config)
    folder.check()  # a file or a broken link where the folder should be: one line, not the claim's OSError
    _refuse_inside_a_checkpoint(folder)
    holder = owner.claim(folder, dump)
    said = _judge_owner(config, folder, holder)
    if said:  # allowed: a run moved, or handed the folder over (one inside the dump folder is its run's anyway)
        owner.hand_over(folder, dump)
    return said


def refuse_another_runs(config: JobConfig, path: Where) -> list[str]:
    """A checkpoint of this run's checkpoint folder written from another dump folder (the folder is shared) is
    that run's: resuming it here would go on with its history in another loss log, and write into its
    checkpoints. Refused, or a WARNING where checkpoint.allow_config_change names job.dump_folder. Not checked
    for a checkpoint folder inside the dump folder (moved with it) or a checkpoint given as initial_load_path."""
    folder, checkpoint = folder_of(config), locate(path)
    dump = Path(_dump_folder(config))
    if checkpoint != folder / checkpoint.name or owner.moves_with(folder, dump):
        return []
    saved = (run_record.read_record(checkpoint) or {}).get(WRITTEN_BY)
    if not isinstance(saved, str) or saved == str(dump):
        return []
    if not Path(saved).exists() and _WRITTEN_BY_KEY not in config.checkpoint.allow_config_change:
        raise CheckpointError(_moved(folder, saved, dump))
    said = (f"checkpoint {checkpoint} was written by the run of dump folder {saved}, not this one ({dump}): "
            f"both keep checkpoints in {folder}")
    if _WRITTEN_BY_KEY in config.checkpoint.allow_config_change:
        return [f"WARNING: {said}; this run goes on from it as checkpoint.allow_config_change allows "
                f"{_WRITTEN_BY_KEY}, and saves into that run's checkpoints"]
    raise CheckpointError(f"{said}; resume that run with --job.dump_folder {saved}, give this run its own "
                          f"--checkpoint.folder, or pass --checkpoint.allow_config_change {_WRITTEN_BY_KEY} to "
                          "continue that run's checkpoints from this dump folder")


# --- which checkpoint, and may it be resumed --------------------------------------------------------------
def folder_of(config: JobConfig) -> Location:
    """The run's checkpoint folder: checkpoint.folder under the dump folder, or the URL it names."""
    return checkpoint_folder(config.job.dump_folder, config.checkpoint.folder)


def signing_of(checkpoint: Checkpoint) -> integrity.SigningKey | None:
    """The key checkpoints are signed with (checkpoint.signing_key_env); refused when the variable is unset."""
    return integrity.signing_key(checkpoint.signing_key_env)


def checkpoint_to_resume(config: JobConfig) -> Path | Location | None:
    """The checkpoint this config resumes from (None: a fresh start); its choice of parts is checked too."""
    ckpt = config.checkpoint
    for name in ckpt.exclude_from_loading:
        if name not in layout.PARTS:
            raise ConfigError(f"config checkpoint.exclude_from_loading has {name!r}; valid parts: "
                              f"{', '.join(layout.PARTS)}")
    if not ckpt.enable and not ckpt.initial_load_path and ckpt.load_step < 0:
        return None
    # Without checkpoint.enable a named checkpoint is loaded and nothing is saved: a run that only looks.
    return layout.resolve_checkpoint(folder_of(config), ckpt.load_step, ckpt.initial_load_path)


def model_blocks(config: JobConfig) -> Callable[[], int | None]:
    """The number of repeated blocks of the config's model (its train spec's first block list; None: it has
    none), counted when first asked on a model built on the meta device (no memory, no random draw)."""

    @functools.cache
    def count() -> int | None:
        spec = get_train_spec(config)
        if spec.block_lists is None:
            return None
        with torch.device("meta"):
            return len(spec.block_lists(spec.build_model(config))[0])

    return count


def compared_by(config: JobConfig) -> run_record.Compared:
    """How this config's run compares a record's config with its own (its parallel mode's view)."""
    rule, blocks = mode_of(config.parallelism), model_blocks(config)
    return lambda values: rule.compared(values, blocks)


def vet_for(config: JobConfig, path: Where, record: dict[str, Any], world_size: int | None,
            device: torch.device = torch.device("cpu")) -> Vetted:
    """The trainer's vetting of ``path``: the plan's layout rule, this run's record, the config's allowances.
    ``world_size`` None: not known yet (the launcher of one node among several)."""
    rule = mode_of(config.parallelism)
    on_change = config.checkpoint.on_world_size_change
    vetted = vet(path, layout=lambda info: rule.check_checkpoint(info, world_size, on_change), record=record,
                 allowed=config.checkpoint.allow_config_change, device=device,
                 signing=signing_of(config.checkpoint), compared=compared_by(config))
    vetted.warnings.extend(refuse_another_runs(config, path))
    return vetted


# --- loading, and how the streams start ---------------------------------------------------------------------
@dataclass
class StreamPlan:
    """How the global streams start at the first resumed step."""

    mode: str  # "fresh" | "restore" | "host_only" | "reseed"
    step: int = 0


def resume(config: JobConfig, plan: ParallelPlan, checkpointer: CheckpointManager, train_state: TrainState,
           sampler: Any, log: Callable[[str], None]) -> tuple[StreamPlan, Path | Location | None]:
    """Load the checkpoint to start from, if any; returns how the random streams start and the checkpoint loaded
    (None: a fresh start). ``log`` prints on rank 0."""
    if config.checkpoint.enable:
        for line in layout.ignored_entries(checkpointer.folder):
            log(f"note: {line}")
    path = checkpoint_to_resume(config)
    if path is None:
        refuse_overwrite(config, 0)
        return StreamPlan("fresh"), None
    world = plan.world
    vetted = vet_for(config, path, checkpointer.run_record, world.world_size, world.device)
    ckpt = config.checkpoint
    keep_loader = plan.loads_dataloader and not vetted.reseed
    result = checkpointer.load(vetted.info, exclude=[*ckpt.exclude_from_loading,
                                                     *([] if keep_loader else [layout.DATALOADER])])
    skips.refuse_past_steps(config.training, run_record.read_record(path), path, train_state.step)
    refuse_overwrite(config, train_state.step)
    for line in vetted.warnings:  # once the resume goes on: a note that it does must not precede a refusal
        log(line)
    plan.position_data(sampler, train_state.step, saved_data_ranks(vetted.info), vetted.reseed)
    if not plan.carries_streams:  # each step seeds its own streams
        return StreamPlan("fresh"), path
    # A missing train state (RNG) is the stream policy's to judge, below.
    others = [name for name in result.missing if not name.startswith(layout.TRAIN_STATE)]
    if others:
        log(f"WARNING: checkpoint {path} holds no {', '.join(others)}; those start fresh")
    no_rng = any(key == layout.TRAIN_STATE or key.startswith(layout.TRAIN_STATE + ".") for key in result.missing)
    moved = _layout_change(vetted.info, world.world_size, config.parallelism.tensor_parallel_degree) \
        if vetted.reseed else ""
    return plan_streams(config.checkpoint, train_state, path, vetted.reseed, no_rng, moved, log), path


def _layout_change(info: layout.CheckpointInfo, world_size: int, tensor_degree: int) -> str:
    """How this run's layout differs from the one that saved ``info`` (process count, tensor-parallel degree)."""
    saved_tp = saved_tensor_degree(info)
    if saved_tp == tensor_degree:
        return f"with {world_size} processes instead of the ones that saved it"
    return (f"with {world_size} processes at {TENSOR_KEY} = {tensor_degree} instead of the "
            f"{info.saved_world_size} at {saved_tp} that saved it")


def refuse_overwrite(config: JobConfig, start: int) -> None:
    """Refuse, before training from step ``start``, a save this run would make over what is not its own
    (layout.refuse_overwrite)."""
    ckpt, last_step = config.checkpoint, config.training.steps
    if ckpt.enable:
        layout.refuse_overwrite(folder_of(config), [step for step in range(start + 1, last_step + 1)
                                                    if saves_at(step, ckpt.interval, last_step)])


def plan_streams(ckpt: Checkpoint, train_state: TrainState, path: Where, reseeded: bool, no_rng: bool,
                 moved: str, warn: Callable[[str], None]) -> StreamPlan:
    """Apply the policies above to what was loaded; warnings go through ``warn`` (rank 0 prints). ``moved``: how
    the layout changed, for a reseeded resume's warning."""
    if not ckpt.restore_rng or layout.TRAIN_STATE in ckpt.exclude_from_loading:
        return StreamPlan("fresh")
    step = train_state.step
    if reseeded:
        warn(f"WARNING: resuming {path} {moved}: model and optimizer are resharded; every rank's random streams "
             "are reseeded from (seed, \"reseed\", step) and its data shard and stage (the ranks of a "
             "tensor-parallel group alike), the data keeps its global position; this run is no longer exact")
        return StreamPlan("reseed", step)
    if no_rng:
        if ckpt.strict_rng:
            raise CheckpointError(
                f"checkpoint {path} holds no RNG state (saved by an older version or another tool) and "
                "checkpoint.strict_rng is set; drop --checkpoint.strict_rng to resume inexactly"
            )
        warn(f"WARNING: checkpoint {path} holds no RNG state (saved by an older version or another tool): "
             "random streams are reseeded and this run is not exact; --checkpoint.strict_rng makes this an error")
        return StreamPlan("reseed", step)
    saved_device = train_state.loaded["device_type"] if train_state.loaded else train_state.device.type
    if saved_device != train_state.device.type:
        if not ckpt.allow_device_type_change:
            raise CheckpointError(
                f"checkpoint {path} was saved on {saved_device} and this run is on "
                f"{train_state.device.type}: the device random stream cannot be restored here; pass "
                "--checkpoint.allow_device_type_change to restore the CPU, NumPy and Python streams (inexact)"
            )
        warn(f"WARNING: checkpoint {path} was saved on {saved_device}, this run is on "
             f"{train_state.device.type}: CPU, NumPy and Python streams restored, the device stream reseeded; "
             "this run is not exact")
        return StreamPlan("host_only", step)
    return StreamPlan("restore", step)


def start_streams(plan: StreamPlan, train_state: TrainState, seed: int, rank: int) -> None:
    """Set the global streams; call it last before the first step (after every start-up draw). ``rank``: what
    seeds this rank's fresh or reseeded streams (the plan's ``stream_rank``)."""
    if plan.mode == "restore":
        train_state.restore_rng()
        return
    if plan.mode == "fresh":
        seed_training_streams(seed, rank)
        return
    seed_training_streams(stream_seed("reseed", seed, plan.step), rank)
    if plan.mode == "host_only":
        train_state.restore_rng(include_device=False)
