"""The job configuration: dataclass sections filled from defaults, then a TOML file, then the command line.

Precedence is CLI > TOML > defaults. Anything unknown or ill-typed raises :class:`ConfigError` with one
line naming it; the entry points turn that into exit code 2 without a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtitan_rng.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib as toml_reader
else:  # pragma: no cover - Python 3.10
    import tomli as toml_reader


# The random streams a run fingerprints (debug.rng_fingerprint), in the order diagnoses list them; a
# generator registered with rng.register_generator is the stream "registered.NAME".
RNG_STREAMS = ("python", "numpy", "torch_cpu", "device", "dataloader")
COMPILE_COMPONENTS = ("model", "loss")
_PERTURB_RNG = re.compile(r"^(?P<stream>[A-Za-z_][\w.-]*):(?P<rank>\d+):(?P<step>\d+)$")


@dataclass
class Job:
    config_file: str = ""
    dump_folder: str = "./outputs"
    description: str = ""
    # A module imported before the model is looked up; it may register its own train spec (see README).
    custom_module: str = ""


@dataclass
class Model:
    name: str = "llama"
    flavor: str = "debug"
    # LLM vocabulary; 0 or -1: derived from the data (largest token id + 1 of a .bin, 256 for byte-level text).
    vocab_size: int = 0


@dataclass
class Training:
    steps: int = 20
    local_batch_size: int = 8
    seq_len: int = 64
    max_norm: float = 1.0
    # LLM data: a .bin token file (flat little-endian uint16), a .jsonl ("text" per line) or a UTF-8 text
    # file; empty means the text that ships with Python itself.
    dataset_path: str = ""
    # Flux: probability of replacing a caption by the empty prompt (classifier-free guidance).
    classifier_free_guidance_prob: float = 0.1
    # Flux: "uniform" or "logit_normal" timesteps.
    timestep_sampling: str = "logit_normal"
    image_size: int = 16
    # Samples per optimizer step over all data-parallel ranks, in micro-batches of local_batch_size; -1:
    # local_batch_size x data-parallel size. Ordinary data parallelism accumulates gradients over
    # global / (local x dp) micro-batches; parallelism.world_size_invariant splits them its own way.
    global_batch_size: int = -1
    # "bfloat16": bf16 compute (FSDP2 parameters with several processes, autocast with one).
    mixed_precision_param: str = "float32"
    # The dtype gradients are reduced in across ranks (FSDP2).
    mixed_precision_reduce: str = "float32"


@dataclass
class Compile:
    enable: bool = False
    # What to compile: "model" (each transformer block) and "loss" (the loss around the model call).
    components: list[str] = field(default_factory=lambda: ["model", "loss"])


@dataclass
class ActivationCheckpoint:
    # "none", "full" (every block) or "selective" (see selective_ac_option).
    mode: str = "none"
    # "op": save matmul outputs and recompute the rest in every block; an integer N: every Nth block in full.
    selective_ac_option: str = "op"


@dataclass
class Data:
    num_workers: int = 0
    # Samples per epoch (0 = everything the dataset has); small values make debug runs cross epochs.
    num_samples: int = 0
    prefetch_factor: int = 2
    # Worker snapshots (they carry form-2 worker RNGs); 0 = every checkpoint.interval steps, so checkpoints
    # land on one and a stop between two replays at most interval-1 steps of batches on resume.
    snapshot_every_n_steps: int = 0
    # Carry the global RNGs that a dataset uses inside worker processes across a resume (form 2).
    capture_worker_rng: bool = True
    # Form 2 and a changed num_workers cannot resume exactly; "error" refuses, "warn" continues inexactly.
    on_num_workers_change: str = "error"
    # LLM: read dataset_path front to back (no index over the file) through a shuffle buffer of
    # shuffle_buffer windows; position and buffer contents are saved with the checkpoint.
    streaming: bool = False
    shuffle_buffer: int = 256


@dataclass
class Optimizer:
    name: str = "AdamW"
    lr: float = 1e-3
    eps: float = 1e-8
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95


@dataclass
class LRScheduler:
    warmup_steps: int = 2
    # The step count the decay is planned for; 0 means training.steps. Pin it to stop early and resume.
    total_steps: int = 0
    decay_type: str = "linear"
    min_lr_factor: float = 0.0


@dataclass
class Checkpoint:
    enable: bool = False
    folder: str = "checkpoint"
    interval: int = 10
    # Load this step instead of the newest complete checkpoint (-1: newest).
    load_step: int = -1
    # Keep only the newest k complete checkpoints (0: keep all).
    keep_latest_k: int = 0
    # A checkpoint folder (step-N) or a folder of them, used when dump_folder has no checkpoint yet.
    initial_load_path: str = ""
    # Parts not to load: any of model, optimizer, lr_scheduler, dataloader, train_state.
    exclude_from_loading: list[str] = field(default_factory=list)
    # "disabled" or "async" (the loop goes on while DCP writes).
    async_mode: str = "disabled"
    # Restore the saved random streams on resume; switch off only to see what breaks without it.
    restore_rng: bool = True
    # What to do when resuming with another number of processes: "error" or "reseed" (inexact).
    on_world_size_change: str = "error"
    # Refuse checkpoints that carry no RNG state instead of loading them with a warning.
    strict_rng: bool = False
    # Restore the CPU/NumPy/Python streams from a checkpoint saved on another device type.
    allow_device_type_change: bool = False
    # Keys that may differ from the checkpoint's run record (a WARNING each); any other change is refused.
    allow_config_change: list[str] = field(default_factory=list)


@dataclass
class Metrics:
    # torchtitan's default: the host reads the steps' values (a device sync) once per 10 steps.
    log_freq: int = 10


@dataclass
class Parallelism:
    # Processes that shard the model (FSDP2); -1 means all of them.
    data_parallel_shard_degree: int = -1
    # The same bits at any power-of-two process count: micro-batches by global position, random streams per
    # micro-batch, gradients summed in one fixed tree, parameters replicated (README: replay on one machine).
    world_size_invariant: bool = False


@dataclass
class Validation:
    enable: bool = False
    freq: int = 5


@dataclass
class Debug:
    seed: int = 0
    deterministic: bool = False
    # Write a fingerprint of every random stream, per rank, into each loss-log line.
    rng_fingerprint: bool = False
    # Fault injection for testing diagnosis: "STREAM:RANK:STEP" disturbs one random stream of one rank on
    # entering one step (STREAM: one of RNG_STREAMS or registered.NAME); empty: off.
    perturb_rng: str = ""


@dataclass
class Signals:
    # Signals that make all ranks checkpoint at the next step boundary and exit 0.
    checkpoint_on: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])


@dataclass
class JobConfig:
    """The whole configuration of a run, one dataclass per TOML section (``config.training.steps``)."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    compile: Compile = field(default_factory=Compile)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    data: Data = field(default_factory=Data)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    parallelism: Parallelism = field(default_factory=Parallelism)
    validation: Validation = field(default_factory=Validation)
    debug: Debug = field(default_factory=Debug)
    signals: Signals = field(default_factory=Signals)


_CHOICES: dict[str, tuple[str, ...]] = {
    "training.timestep_sampling": ("uniform", "logit_normal"),
    "training.mixed_precision_param": ("float32", "bfloat16"),
    "training.mixed_precision_reduce": ("float32",),
    "activation_checkpoint.mode": ("none", "full", "selective"),
    "data.on_num_workers_change": ("error", "warn"),
    "optimizer.name": ("AdamW", "Adam", "SGD"),
    "lr_scheduler.decay_type": ("linear", "cosine", "constant"),
    "checkpoint.async_mode": ("disabled", "async"),
    "checkpoint.on_world_size_change": ("error", "reseed"),
}

# (key, lowest allowed value) for numbers that must not be below a bound.
_MINIMUMS: dict[str, float] = {
    "model.vocab_size": -1,
    "training.steps": 1,
    "training.local_batch_size": 1,
    "training.seq_len": 2,
    "training.max_norm": 0,
    "training.image_size": 4,
    "data.num_workers": 0,
    "data.num_samples": 0,
    "data.prefetch_factor": 1,
    "data.snapshot_every_n_steps": 0,
    "data.shuffle_buffer": 1,
    "optimizer.lr": 0,
    "lr_scheduler.warmup_steps": 0,
    "lr_scheduler.total_steps": 0,
    "checkpoint.interval": 1,
    "checkpoint.keep_latest_k": 0,
    "metrics.log_freq": 1,
    "validation.freq": 1,
}


def _section_fields(section: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section)}


def _convert(dotted: str, raw: Any, annotation: Any, from_cli: bool) -> Any:
    """Coerce one value to the field's type, or raise ConfigError naming the key."""
    origin = typing.get_origin(annotation)
    type_name = getattr(annotation, "__name__", str(annotation))
    if raw is _BARE:
        if annotation is bool:
            return True
        raise ConfigError(f"--{dotted} needs a value: --{dotted} VALUE (or --{dotted}=VALUE)")
    if origin is list:
        if from_cli and isinstance(raw, str):
            return [part for part in raw.split(",") if part]
        if isinstance(raw, list) and all(isinstance(item, str) for item in raw):
            return raw
        raise ConfigError(f"config {dotted}: expected a list of strings, got {raw!r}")
    if annotation is bool:
        if isinstance(raw, bool):
            return raw
        if from_cli and isinstance(raw, str) and raw.lower() in ("true", "false", "1", "0", "yes", "no"):
            return raw.lower() in ("true", "1", "yes")
        raise ConfigError(f"config {dotted}: expected true or false, got {raw!r}")
    if annotation is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if from_cli and isinstance(raw, str):
            try:
                return int(raw)
            except ValueError:
                pass
        raise ConfigError(f"config {dotted}: expected an integer, got {raw!r}")
    if annotation is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        if from_cli and isinstance(raw, str):
            try:
                return float(raw)
            except ValueError:
                pass
        raise ConfigError(f"config {dotted}: expected a number, got {raw!r}")
    if annotation is str:
        if isinstance(raw, str):
            return raw
        raise ConfigError(f"config {dotted}: expected a string, got {raw!r}")
    raise ConfigError(f"config {dotted}: unsupported type {type_name}")  # pragma: no cover


def _set(config: JobConfig, dotted: str, raw: Any, from_cli: bool) -> None:
    section_name, _, key = dotted.partition(".")
    sections = _section_fields(config)
    if section_name not in sections or not key:
        raise ConfigError(f"unknown config section {section_name!r}; valid sections: {', '.join(sections)}")
    section = getattr(config, section_name)
    fields = _section_fields(section)
    if key not in fields:
        raise ConfigError(f"unknown config key {dotted!r}; valid keys in [{section_name}]: {', '.join(fields)}")
    annotation = typing.get_type_hints(type(section))[key]
    setattr(section, key, _convert(dotted, raw, annotation, from_cli))


def _load_toml(path: str) -> dict[str, Any]:
    file = Path(path)
    if file.is_dir():
        raise ConfigError(f"config file {path!r} is a directory; pass a TOML file to --job.config_file")
    if not file.is_file():
        raise ConfigError(f"config file {path!r} does not exist; pass an existing TOML file to --job.config_file")
    try:
        return toml_reader.loads(file.read_text())
    except (toml_reader.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path!r} is not valid TOML: {err}") from None


# The raw value of a bare ``--a.b``: true for a boolean key, a missing value for any other.
_BARE = object()


def _split_cli(argv: list[str]) -> list[tuple[str, Any]]:
    """``--a.b v``, ``--a.b=v`` and a bare ``--a.b`` (``_BARE``) into (key, raw) pairs, in order."""
    pairs: list[tuple[str, Any]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.key value")
        name = arg[2:]
        if "=" in name:
            name, value = name.split("=", 1)
            pairs.append((name, value))
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append((name, argv[i + 1]))
            i += 2
        else:
            pairs.append((name, _BARE))
            i += 1
    return pairs


def validate(config: JobConfig) -> None:
    """Range and choice checks that apply whatever the source of a value."""
    for dotted, minimum in _MINIMUMS.items():
        section, key = dotted.split(".")
        value = getattr(getattr(config, section), key)
        if value < minimum:
            raise ConfigError(f"config {dotted} = {value} is out of range; it must be >= {minimum:g}")
    for dotted, choices in _CHOICES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(config, section), key)
        if value not in choices:
            raise ConfigError(f"config {dotted} = {value!r} is not valid; choose one of: {', '.join(choices)}")
    probability = config.training.classifier_free_guidance_prob
    if not 0.0 <= probability <= 1.0:
        raise ConfigError(f"config training.classifier_free_guidance_prob = {probability} must be in [0, 1]")
    if config.checkpoint.async_mode == "async" and config.checkpoint.keep_latest_k == 1:
        raise ConfigError(
            "config checkpoint.keep_latest_k = 1 cannot be used with checkpoint.async_mode = 'async' "
            "(the previous checkpoint may still be written); use keep_latest_k >= 2 or 0"
        )
    for name in config.compile.components:
        if name not in COMPILE_COMPONENTS:
            raise ConfigError(
                f"config compile.components has {name!r}; valid components: {', '.join(COMPILE_COMPONENTS)}"
            )
    option = config.activation_checkpoint.selective_ac_option
    if option != "op" and not (option.isdigit() and int(option) >= 1):
        raise ConfigError(
            f"config activation_checkpoint.selective_ac_option = {option!r} is not valid; use \"op\" or a "
            "positive integer N (every Nth block)"
        )
    global_batch = config.training.global_batch_size
    if global_batch != -1 and global_batch < 1:
        raise ConfigError(f"config training.global_batch_size = {global_batch} must be -1 (local x dp) or >= 1")
    if config.debug.perturb_rng:
        parse_perturb_rng(config.debug.perturb_rng)
    _validate_key_list(config, "checkpoint.allow_config_change", config.checkpoint.allow_config_change)


def _validate_key_list(config: JobConfig, dotted: str, keys: list[str]) -> None:
    for name in keys:
        section, _, key = name.partition(".")
        if section not in _section_fields(config) or key not in _section_fields(getattr(config, section)):
            raise ConfigError(f"config {dotted} has {name!r}, which is not a config key (use section.key, "
                              "e.g. optimizer.lr)")


def parse_perturb_rng(value: str) -> tuple[str, int, int]:
    """(stream, rank, step) of debug.perturb_rng = "STREAM:RANK:STEP"."""
    match = _PERTURB_RNG.match(value)
    stream = match.group("stream") if match else ""
    if not match or not (stream in RNG_STREAMS or (stream.startswith("registered.") and len(stream) > 11)):
        raise ConfigError(
            f"config debug.perturb_rng = {value!r} is not valid; use STREAM:RANK:STEP with STREAM one of "
            f"{', '.join(RNG_STREAMS)} or registered.NAME (e.g. torch_cpu:1:7)"
        )
    rank, step = int(match.group("rank")), int(match.group("step"))
    if step < 1:
        raise ConfigError(f"config debug.perturb_rng = {value!r}: the step must be >= 1")
    return stream, rank, step


def parse_args(argv: list[str]) -> JobConfig:
    """Defaults, then the TOML file named by --job.config_file, then every other override."""
    pairs = _split_cli(argv)
    config = JobConfig()
    config_files = [_convert(name, raw, str, from_cli=True) for name, raw in pairs if name == "job.config_file"]
    if config_files:
        for section_name, values in _load_toml(config_files[-1]).items():
            if not isinstance(values, dict):
                raise ConfigError(f"config file: {section_name!r} must be a [section] table")
            for key, raw in values.items():
                _set(config, f"{section_name}.{key}", raw, from_cli=False)
    for name, raw in pairs:
        _set(config, name, raw, from_cli=True)
    validate(config)
    return config


def usage(prog: str) -> str:
    """What ``--help`` prints: how overrides are written, then every key with its type and default."""
    lines = [f"usage: {prog} --job.config_file FILE [--section.key VALUE ...]", "",
             "Values come from the defaults below, then the TOML file, then the command line (last wins).",
             "A bare --section.key sets a true/false key to true; lists are comma-separated.", ""]
    for section in dataclasses.fields(JobConfig):
        defaults = section.default_factory()
        hints = typing.get_type_hints(type(defaults))
        lines.append(f"[{section.name}]")
        for key in _section_fields(defaults):
            dotted = f"{section.name}.{key}"
            type_name = "list of str" if typing.get_origin(hints[key]) is list else hints[key].__name__
            choices = f", one of {', '.join(_CHOICES[dotted])}" if dotted in _CHOICES else ""
            lines.append(f"  --{dotted} ({type_name}{choices}; default {json.dumps(getattr(defaults, key))})")
    return "\n".join(lines)


def lr_total_steps(config: JobConfig) -> int:
    """The horizon of the learning-rate schedule (pinned by lr_scheduler.total_steps)."""
    return config.lr_scheduler.total_steps or config.training.steps


def snapshot_every_n_steps(config: JobConfig) -> int:
    """Optimizer steps between two dataloader snapshots: data.snapshot_every_n_steps, 0 = checkpoint.interval."""
    return config.data.snapshot_every_n_steps or config.checkpoint.interval


def gradient_accumulation_steps(config: JobConfig, dp_world: int) -> int:
    """Micro-batches per optimizer step: global_batch_size / (local_batch_size x dp), which must divide."""
    local = config.training.local_batch_size * dp_world
    global_batch = config.training.global_batch_size
    if global_batch == -1:
        return 1
    if global_batch % local:
        raise ConfigError(
            f"config training.global_batch_size = {global_batch} is not a multiple of local_batch_size x "
            f"data-parallel size = {config.training.local_batch_size} x {dp_world} = {local}; choose a multiple"
        )
    return global_batch // local


# The parameters that the library layers (checkpoint manager, own-loop API, dataloader) name in their errors
# (``load_step=5``), and the config key a trainer user sets instead (``--checkpoint.load_step 5``).
_LIBRARY_PARAMETERS = {
    "load_step": "checkpoint.load_step",
    "initial_load_path": "checkpoint.initial_load_path",
    "on_world_size_change": "checkpoint.on_world_size_change",
    "exclude": "checkpoint.exclude_from_loading",
    "num_workers": "data.num_workers",
    "on_num_workers_change": "data.on_num_workers_change",
}
_LIBRARY_PARAMETER = re.compile(r"\b(" + "|".join(_LIBRARY_PARAMETERS) + r""")=("[^"]*"|'[^']*'|[\w.+-]*)""")


def as_flags(message: str) -> str:
    """A library error worded for a trainer user: ``load_step=5`` becomes ``--checkpoint.load_step 5``."""
    def flag(match: re.Match[str]) -> str:
        value = match.group(2).strip('"')
        return f"--{_LIBRARY_PARAMETERS[match.group(1)]}" + (f" {value}" if value else "")

    return _LIBRARY_PARAMETER.sub(flag, message)


def to_dict(config: JobConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)
