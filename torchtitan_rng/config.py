"""The job configuration: dataclass sections filled from defaults, then a TOML file, then the command line.

Precedence is CLI > TOML > defaults. Anything unknown or ill-typed raises :class:`ConfigError` with one
line naming it; the entry points turn that into exit code 2 without a traceback.
"""

from __future__ import annotations

import bisect
import collections.abc
import dataclasses
import json
import math
import re
import sys
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from torchtitan_rng.errors import ConfigError
from torchtitan_rng.signals import TRAINER_SIGNALS

if sys.version_info >= (3, 11):
    import tomllib as toml_reader
else:  # pragma: no cover - Python 3.10
    import tomli as toml_reader


# The random streams a run fingerprints (debug.rng_fingerprint), in the order diagnoses list them; a
# generator registered with rng.register_generator is the stream "registered.NAME".
RNG_STREAMS = ("python", "numpy", "torch_cpu", "device", "dataloader")
COMPILE_COMPONENTS = ("model", "loss")
# torch.distributed.pipelining's schedules, by the names torchtitan's config uses.
PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
_PERTURB_RNG = re.compile(r"^(?P<stream>[A-Za-z_][\w.-]*):(?P<rank>\d+):(?P<step>\d+)$")


def _key(default: Any, meaning: str, *, choices: tuple[str, ...] = ()) -> Any:
    """A config key's default and meaning (and, for a string, its valid values): ``--help`` and the generated
    docs/config.md print them, and validate() checks the choices."""
    metadata = {"help": meaning, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class Job:
    config_file: str = _key("", "the TOML file the other values come from (CLI overrides it)")
    dump_folder: str = _key("./outputs", "where the checkpoints, the loss log and validation pictures go; a relative "
                            "path means the directory you run from")
    description: str = _key("", "free text, printed first when the run starts and kept in each checkpoint's "
                            "run.json")
    custom_module: str = _key("", "a module imported before model.name is looked up; it may register its own "
                              "train spec (register_train_spec): see docs/api.md")


@dataclass
class Model:
    name: str = _key("llama", "the registered train spec: llama (an LLM), flux (a diffusion model), or one of "
                     "job.custom_module")
    flavor: str = _key("debug", "the model's size, as its train spec names them (llama: debug, small, bench; "
                       "flux: debug, small)")
    vocab_size: int = _key(0, "LLM vocabulary; 0 or -1: derived from the data (largest token id + 1 of a .bin, 256 "
                           "for byte-level text); set: data that does not fit is refused at start")


@dataclass
class Training:
    steps: int = _key(20, "the last step of this run (a resumed run continues to it)")
    local_batch_size: int = _key(8, "samples per micro-batch per process")
    seq_len: int = _key(64, "LLM: tokens per sample")
    max_norm: float = _key(1.0, "gradient clipping by total norm; 0: off")
    dataset_path: str = _key("", "LLM data: a .bin token file (flat little-endian uint16), a .jsonl file (a "
                             "\"text\" per line) or UTF-8 text; empty: text that ships with Python (docs/data.md)")
    classifier_free_guidance_prob: float = _key(0.1, "Flux: probability that a caption is replaced by the empty "
                                                "prompt (classifier-free guidance), in [0, 1]")
    timestep_sampling: str = _key("logit_normal", "Flux: how each step draws its diffusion timesteps",
                                  choices=("uniform", "logit_normal"))
    image_size: int = _key(16, "Flux: image side in pixels")
    global_batch_size: int = _key(-1, "samples per optimizer step over all processes, in micro-batches of "
                                  "local_batch_size; -1: local_batch_size x processes (no accumulation); "
                                  "gradients accumulate over global / (local x processes) micro-batches")
    mixed_precision_param: str = _key("float32", "compute dtype: bfloat16 gathers FSDP2 parameters in bf16 with "
                                      "several processes, or autocasts with one (and in the world-size-invariant "
                                      "mode)", choices=("float32", "bfloat16"))
    mixed_precision_reduce: str = _key("float32", "the dtype gradients are reduced in across processes (FSDP2)",
                                       choices=("float32",))
    skip_steps: str = _key("", "steps that apply no update, e.g. 6,9 or 40-43 (docs/spikes.md): each still loads its "
                           "data and draws its random numbers as if it trained, the learning-rate schedule and the "
                           "step counters (the run's and the optimizer's) advance, the weights and the optimizer's "
                           "moments stay; its loss-log line says \"skipped\": true. May be added at a resume (a "
                           "note), for steps after the checkpoint")
    spike_guard: str = _key("", "skip a step whose loss or gradient norm spikes, decided on the device (no host "
                            "read): METRIC,RULE[,window=N][,warmup=N], METRIC loss, grad_norm or loss+grad_norm, "
                            "RULE factor=F (value > F x the rolling mean) or zscore=Z (value > mean + Z x std); the "
                            "rolling window (default 50, at most 10000) holds the last trained steps' values, and no step is judged "
                            "before warmup (default 10) of them; a NaN or infinite value is always a spike. E.g. "
                            "loss,factor=3 (docs/spikes.md)")


@dataclass
class Compile:
    enable: bool = _key(False, "torch.compile the components below (static shapes)")
    components: list[str] = _key(["model", "loss"], "what to compile, any of: model (each transformer block), "
                                 "loss (the loss function around the model call)")


@dataclass
class ActivationCheckpoint:
    mode: str = _key("none", "recompute activations in the backward: full (every block) or selective (see "
                     "selective_ac_option)", choices=("none", "full", "selective"))
    selective_ac_option: str = _key("op", "selective mode: op (save matmul outputs, recompute the rest of every "
                                    "block) or an integer N (every Nth block in full)")


@dataclass
class Data:
    num_workers: int = _key(0, "dataloader worker processes per process")
    num_samples: int = _key(0, "samples per epoch; 0: all the dataset has (small values make debug runs cross "
                            "epochs)")
    prefetch_factor: int = _key(2, "batches each worker prepares ahead")
    snapshot_every_n_steps: int = _key(0, "steps between two dataloader snapshots (they carry the workers' state "
                                       "and RNGs); 0: every checkpoint.interval steps, so interval checkpoints land "
                                       "on one and a stop between two replays at most interval-1 steps of batches")
    capture_worker_rng: bool = _key(True, "carry the global RNGs a dataset uses inside worker processes across a "
                                    "resume (form 2 of docs/data.md)")
    on_num_workers_change: str = _key("error", "a form-2 dataset resumed with another num_workers cannot be exact: "
                                      "error refuses, warn continues inexactly", choices=("error", "warn"))
    streaming: bool = _key(False, "LLM: read dataset_path front to back (no index over the file) through a "
                           "shuffle buffer; the file position and buffers are saved with the checkpoint")
    shuffle_buffer: int = _key(256, "streaming: windows each stream holds and draws from")


@dataclass
class Optimizer:
    name: str = _key("AdamW", "the torch.optim optimizer that updates the parameters", choices=("AdamW", "Adam", "SGD"))
    lr: float = _key(1e-3, "peak learning rate (the schedule scales it)")
    eps: float = _key(1e-8, "Adam(W): added to the denominator (the second moment's square root) so that it is "
                            "never zero")
    weight_decay: float = _key(0.1, "AdamW: each step shrinks every weight by lr x this (decoupled); Adam and SGD: "
                                    "this x the weight is added to its gradient (L2)")
    beta1: float = _key(0.9, "Adam(W): first-moment decay")
    beta2: float = _key(0.95, "Adam(W): second-moment decay")


@dataclass
class LRScheduler:
    warmup_steps: int = _key(2, "steps of linear warmup")
    total_steps: int = _key(0, "the step count the decay is planned for; 0: training.steps. Pin it to stop early "
                            "and resume on the same curve")
    decay_type: str = _key("linear", "the decay after warmup", choices=("linear", "cosine", "constant"))
    min_lr_factor: float = _key(0.0, "the lr at the end of the decay, as a fraction of optimizer.lr")


@dataclass
class Checkpoint:
    enable: bool = _key(False, "save checkpoints, and resume from the newest complete one at start (a stop signal "
                        "saves even when off)")
    folder: str = _key("checkpoint", "the checkpoint folder, under job.dump_folder; or a URL on its own (s3://bucket/"
                       "prefix, gs://..., file:///path; docs/storage.md)")
    interval: int = _key(10, "save every N steps (and at the last step)")
    load_step: int = _key(-1, "resume from this step instead of the newest complete checkpoint; -1: newest")
    keep_latest_k: int = _key(0, "keep only the newest k complete checkpoints; 0: all")
    initial_load_path: str = _key("", "a step-N folder, or a folder of them (a path or a URL), to start from when the dump folder has "
                                  "no checkpoint yet; without checkpoint.enable it is loaded and nothing is saved "
                                  "(a run that only looks)")
    exclude_from_loading: list[str] = _key([], "checkpoint parts not to load, any of: model, optimizer, "
                                           "lr_scheduler, dataloader, train_state")
    async_mode: str = _key("disabled", "async: the loop goes on while the save is written in the background "
                           "(the last step's save stays synchronous)", choices=("disabled", "async"))
    restore_rng: bool = _key(True, "restore the saved random streams on resume; switch off only to see what breaks "
                             "without it")
    on_world_size_change: str = _key("error", "resuming with another number of processes: error refuses, reseed "
                                     "continues inexactly", choices=("error", "reseed"))
    strict_rng: bool = _key(False, "refuse a checkpoint that holds no RNG state instead of loading it with a "
                            "WARNING")
    allow_device_type_change: bool = _key(False, "resume a checkpoint saved on another device type: the CPU, NumPy "
                                          "and Python streams are restored, the device stream reseeded (inexact)")
    allow_config_change: list[str] = _key([], "keys (section.key) that may differ from the checkpoint's run.json, "
                                          "a WARNING each; any other trajectory change is refused")
    signing_key_env: str = _key("", "the NAME of an environment variable holding a secret key: each checkpoint's "
                                "checksums are signed with it (HMAC-SHA256) and a resume refuses one whose "
                                "signature does not match; empty: unsigned")


@dataclass
class Metrics:
    log_freq: int = _key(10, "every N steps: the progress line and a loss-log write, when the host reads the "
                         "steps' values (also at every checkpoint, a stop and the last step)")
    log_samples: bool = _key(False, "write the sample keys of every micro-batch into each loss-log line (\"samples\", "
                             "in slot order), gathered at the log's sync points (docs/spikes.md)")


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = _key(-1, "processes that shard each stage of the model (FSDP2), as in "
                                           "torchtitan: data_parallel_shard_degree x tensor_parallel_degree x "
                                           "pipeline_parallel_degree = the process count; -1: what the other degrees "
                                           "leave (processes / (tp x pp))")
    tensor_parallel_degree: int = _key(1, "processes that split each layer's weights (tensor parallelism with "
                                       "torch's DTensor styles, docs/tensor_parallel.md); they read the same "
                                       "batches and hold the same random streams")
    world_size_invariant: bool = _key(False, "the same bits at any process count that divides the micro-batches per "
                                      "step: micro-batches by global position, random streams per micro-batch, "
                                      "gradients summed in slot order, sharded by FSDP2 (docs/world_size_invariant.md)")
    pipeline_parallel_degree: int = _key(1, "pipeline stages the model is split over (docs/pipeline.md); the "
                                         "processes are pp x dp, each stage sharded by FSDP2 over its dp ranks")
    pipeline_parallel_schedule: str = _key("1F1B", "the order a rank runs its micro-batches in (it sets the "
                                           "order of dropout draws and of gradient sums)",
                                           choices=PIPELINE_SCHEDULES)
    pipeline_parallel_microbatch_size: int = _key(0, "samples per pipeline micro-batch; it divides "
                                                  "training.local_batch_size; 0: 1, or training.local_batch_size with "
                                                  "parallelism.world_size_invariant (the only size that mode runs)")
    pipeline_parallel_split_points: list[str] = _key([], "where stages start, as layers.N (N-1 names for N "
                                                     "stages); empty: layers split evenly")
    tensor_parallel_chunks: int = _key(4, "with parallelism.world_size_invariant: the chunks every tensor-split "
                                       "dimension (attention heads, MLP hidden features) is computed in, at every "
                                       "tensor-parallel degree, so that any degree dividing it gives the same bits "
                                       "(the largest degree the run may use; docs/world_size_invariant.md)")


@dataclass
class Validation:
    enable: bool = _key(False, "run the train spec's validation pass (Flux: val_loss and a picture grid)")
    freq: int = _key(5, "validate every N steps")


@dataclass
class Debug:
    seed: int = _key(0, "the one seed every random stream of the run derives from (docs/randomness.md)")
    deterministic: bool = _key(False, "torch's deterministic algorithms (and a fixed cuBLAS workspace)")
    rng_fingerprint: bool = _key(False, "write a fingerprint of every random stream, per rank, into each "
                                 "loss-log line (docs/diagnosis.md)")
    tensor_fingerprint: bool = _key(False, "write a hash of each micro-batch, its loss, each gradient and parameter, "
                                    "per step and rank (the optimizer state at saves), and the run's config, into "
                                    "tensor_fingerprints/ in the dump folder; compare_losses then names the first "
                                    "tensor that differs (docs/diagnosis.md)")
    fingerprint_modules_at_step: int = _key(0, "with debug.tensor_fingerprint: at this step also hash the inputs and "
                                            "outputs of every module (forward hooks, that step only); 0: none")
    fingerprint_optimizer_every_step: bool = _key(False, "with debug.tensor_fingerprint: hash the optimizer state "
                                                  "after every step's update, not only at saves and where a process "
                                                  "starts (with AdamW, twice the bytes a step hashes)")
    perturb_rng: str = _key("", "fault injection STREAM:RANK:STEP: one extra draw from one stream of one rank "
                            "entering one step (STREAM: " + ", ".join(RNG_STREAMS) + " or registered.NAME); "
                            "empty: off")


@dataclass
class Signals:
    checkpoint_on: list[str] = _key(list(TRAINER_SIGNALS), "signals that make every rank checkpoint at "
                                    "the next step boundary and exit 0; a second SIGINT (Ctrl-C) aborts without a "
                                    "save (docs/clusters.md)")


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


# (key, lowest allowed value) for numbers that must not be below a bound.
_MINIMUMS: dict[str, float] = {
    "model.vocab_size": -1,
    "training.steps": 1,
    "training.local_batch_size": 1,
    "parallelism.pipeline_parallel_degree": 1,
    "parallelism.tensor_parallel_degree": 1,
    "parallelism.tensor_parallel_chunks": 1,
    "parallelism.pipeline_parallel_microbatch_size": 0,
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
    "debug.fingerprint_modules_at_step": 0,
}


def _section_fields(section: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section)}


@dataclass(frozen=True)
class KeyInfo:
    """One config key as ``--help`` and docs/config.md show it."""

    dotted: str
    type_name: str
    default: Any
    choices: tuple[str, ...]
    minimum: float | None
    meaning: str


def describe_keys(schema: type = JobConfig) -> list[KeyInfo]:
    """Every key of the schema, section by section, from the fields' metadata (``_key``); a key declared
    without one has an empty meaning (a test refuses that)."""
    keys = []
    for section in dataclasses.fields(schema):
        defaults = section.default_factory()
        hints = typing.get_type_hints(type(defaults))
        for name, spec in _section_fields(defaults).items():
            dotted = f"{section.name}.{name}"
            type_name = "list of str" if typing.get_origin(hints[name]) is list else hints[name].__name__
            keys.append(KeyInfo(dotted, type_name, getattr(defaults, name), tuple(spec.metadata.get("choices", ())),
                                _MINIMUMS.get(dotted), spec.metadata.get("help", "")))
    return keys


_CHOICES: dict[str, tuple[str, ...]] = {key.dotted: key.choices for key in describe_keys() if key.choices}


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
        value: float | None = None
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            try:
                value = float(raw)
            except OverflowError:  # a TOML integer past float range
                value = math.inf
        elif from_cli and isinstance(raw, str):
            try:
                value = float(raw)
            except ValueError:
                pass
        if value is None:
            raise ConfigError(f"config {dotted}: expected a number, got {raw!r}")
        if not math.isfinite(value):  # nan, inf, or a literal past float range such as 1e400
            shown = raw if isinstance(raw, str) else repr(value)
            raise ConfigError(f"config {dotted} = {shown} is not a finite number; give a finite value")
        return value
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
    except RecursionError:
        raise ConfigError(f"config file {path!r} nests arrays or tables too deep to read; a config is sections "
                          "of keys ([section] then key = value)") from None


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
    if config.debug.fingerprint_modules_at_step and not config.debug.tensor_fingerprint:
        raise ConfigError(f"config debug.fingerprint_modules_at_step = {config.debug.fingerprint_modules_at_step} "
                          "records module calls into the tensor fingerprints, which are off: add "
                          "--debug.tensor_fingerprint")
    if config.debug.fingerprint_optimizer_every_step and not config.debug.tensor_fingerprint:
        raise ConfigError("config debug.fingerprint_optimizer_every_step hashes the optimizer state into the tensor "
                          "fingerprints, which are off: add --debug.tensor_fingerprint")
    if not config.job.dump_folder.strip():
        raise ConfigError("config job.dump_folder is empty: name a folder for the run (\".\" for the current one)")
    parse_skip_steps(config.training.skip_steps)
    if parse_spike_guard(config.training.spike_guard) and not (config.metrics.log_samples or config.data.streaming):
        raise ConfigError("config training.spike_guard records the samples of each step it skips: add "
                          "--metrics.log_samples (a streaming source, data.streaming, has none to record)")
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


_SKIP_ITEM = re.compile(r"^(?P<first>\d+)(?:-(?P<last>\d+))?$")


class StepSet(collections.abc.Set):
    """A set of steps kept as sorted, disjoint, non-adjacent ranges, so that ``1-100000000`` costs one pair, not a
    hundred million ints: membership by bisection, differences and cuts range by range."""

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        merged: list[tuple[int, int]] = []
        for first, last in sorted(r for r in ranges if r[0] <= r[1]):
            if merged and first <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], last))
            else:
                merged.append((first, last))
        self.ranges: tuple[tuple[int, int], ...] = tuple(merged)

    @classmethod
    def of(cls, steps: Iterable[int]) -> StepSet:
        return steps if isinstance(steps, StepSet) else cls((step, step) for step in steps)

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        i = bisect.bisect_right(self.ranges, (step, float("inf"))) - 1
        return i >= 0 and self.ranges[i][0] <= step <= self.ranges[i][1]

    def __len__(self) -> int:
        return sum(last - first + 1 for first, last in self.ranges)

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def __iter__(self) -> Iterator[int]:  # lazily: a huge range is never materialised
        for first, last in self.ranges:
            yield from range(first, last + 1)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepSet):
            return self.ranges == other.ranges
        return collections.abc.Set.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StepSet({format_skip_steps(self)!r})"

    def minus(self, other: StepSet) -> StepSet:
        """The steps of this set that ``other`` does not hold, range by range."""
        out: list[tuple[int, int]] = []
        for first, last in self.ranges:
            for o_first, o_last in other.ranges:
                if o_last < first or o_first > last:
                    continue
                if o_first > first:
                    out.append((first, o_first - 1))
                first = max(first, o_last + 1)
                if first > last:
                    break
            if first <= last:
                out.append((first, last))
        return StepSet(out)

    def up_to(self, step: int) -> StepSet:
        """The steps <= ``step``."""
        return StepSet((first, min(last, step)) for first, last in self.ranges if first <= step)


def parse_skip_steps(value: str) -> StepSet:
    """The steps of training.skip_steps = "6,9,40-43" (empty: none), ranges kept as ranges; a ConfigError in one
    line when malformed."""
    ranges: list[tuple[int, int]] = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        match = _SKIP_ITEM.match(item)
        first = int(match.group("first")) if match else 0
        last = int(match.group("last") or first) if match else 0
        if not match or first < 1 or last < first:
            raise ConfigError(f"config training.skip_steps = {value!r} is not valid ({item!r}); use steps and "
                              "ranges FIRST-LAST >= 1 separated by commas, e.g. 6,9,40-43")
        ranges.append((first, last))
    return StepSet(ranges)


def format_skip_steps(steps: Iterable[int]) -> str:
    """The canonical spelling of a set of steps: sorted, runs as ranges ("6,9,40-43")."""
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in StepSet.of(steps).ranges)


GUARD_METRICS = ("loss", "grad_norm")
# The spike guard's largest window: the window is allocated on the device up front and summed at every step, and
# rolling statistics over more than 10000 trained steps judge a spike against another era of the run.
MAX_SPIKE_WINDOW = 10_000


@dataclass(frozen=True)
class SpikeRule:
    """training.spike_guard, parsed: which values, which test, over how many trained steps."""

    metrics: tuple[str, ...]
    rule: str  # "factor" or "zscore"
    threshold: float
    window: int = 50
    warmup: int = 10


def parse_spike_guard(value: str) -> SpikeRule | None:
    """training.spike_guard = "loss,factor=3,window=50,warmup=10" (empty: None); a ConfigError in one line when
    malformed."""
    if not value.strip():
        return None

    def bad(why: str) -> ConfigError:
        return ConfigError(f"config training.spike_guard = {value!r} is not valid ({why}); use METRIC,RULE"
                           "[,window=N][,warmup=N] with METRIC loss, grad_norm or loss+grad_norm and RULE factor=F "
                           "or zscore=Z, e.g. loss,factor=3")

    metric, *options = (part.strip() for part in value.split(","))
    metrics = tuple(metric.split("+"))
    if not metric or any(m not in GUARD_METRICS for m in metrics) or len(set(metrics)) != len(metrics):
        raise bad(f"metric {metric!r}")
    fields: dict[str, str] = {}
    for option in options:
        name, _, number = option.partition("=")
        if name not in ("factor", "zscore", "window", "warmup") or name in fields or not number:
            raise bad(repr(option))
        fields[name] = number
    rules = [name for name in ("factor", "zscore") if name in fields]
    if len(rules) != 1:
        raise bad("give one rule, factor=F or zscore=Z")
    try:
        threshold = float(fields[rules[0]])
        window, warmup = int(fields.get("window", 50)), int(fields.get("warmup", 10))
    except ValueError:
        raise bad("a number that does not read as one") from None
    if not threshold > 0 or not 2 <= warmup <= window:
        raise bad("the rule's number must be > 0 and 2 <= warmup <= window")
    if window > MAX_SPIKE_WINDOW:
        raise bad(f"window={window} is above the largest window, {MAX_SPIKE_WINDOW} trained steps")
    return SpikeRule(metrics, rules[0], threshold, window, warmup)


def parse_args(argv: list[str]) -> JobConfig:
    """Defaults, then the TOML file named by --job.config_file, then every other override."""
    pairs = _split_cli(argv)
    config = JobConfig()
    config_files = [_convert(name, raw, str, from_cli=True) for name, raw in pairs if name == "job.config_file"]
    if config_files and config_files[-1]:  # empty: no file (every value on the command line)
        for section_name, values in _load_toml(config_files[-1]).items():
            if not isinstance(values, dict):
                raise ConfigError(f"config file: {section_name!r} must be a [section] table")
            for key, raw in values.items():
                _set(config, f"{section_name}.{key}", raw, from_cli=False)
    for name, raw in pairs:
        _set(config, name, raw, from_cli=True)
    validate(config)
    return config


def from_values(values: dict[str, Any]) -> JobConfig:
    """The config a run record holds (``section.key``: its JSON value); keys this version does not know are left
    at their defaults."""
    config = JobConfig()
    known = {key.dotted for key in describe_keys()}
    for dotted, raw in values.items():
        if dotted in known:
            _set(config, dotted, raw, from_cli=False)
    validate(config)
    return config


def usage(prog: str) -> str:
    """What ``--help`` prints: how overrides are written, then every key with its type, default and meaning."""
    lines = [f"usage: {prog} --job.config_file FILE [--section.key VALUE ...]", "",
             "Values come from the defaults below, then the TOML file, then the command line (last wins).",
             "A bare --section.key sets a true/false key to true; lists are comma-separated.",
             "The same reference, as a page: docs/config.md.", ""]
    section = ""
    for key in describe_keys():
        if key.dotted.split(".")[0] != section:
            section = key.dotted.split(".")[0]
            lines.append(f"[{section}]")
        choices = f", one of {', '.join(key.choices)}" if key.choices else ""
        minimum = f" (at least {key.minimum:g})" if key.minimum is not None else ""
        lines.append(f"  --{key.dotted} ({key.type_name}{choices}; default {json.dumps(key.default)})")
        lines.extend(f"      {line}" for line in textwrap.wrap(key.meaning + minimum, 100))
    return "\n".join(lines)


def lr_total_steps(config: JobConfig) -> int:
    """The horizon of the learning-rate schedule (pinned by lr_scheduler.total_steps)."""
    return config.lr_scheduler.total_steps or config.training.steps


def snapshot_every_n_steps(config: JobConfig) -> int:
    """Optimizer steps between two dataloader snapshots: data.snapshot_every_n_steps, 0 = checkpoint.interval."""
    return config.data.snapshot_every_n_steps or config.checkpoint.interval


def gradient_accumulation_steps(training: Training, dp_world: int) -> int:
    """Micro-batches per optimizer step: global_batch_size / (local_batch_size x dp), which must divide."""
    local = training.local_batch_size * dp_world
    global_batch = training.global_batch_size
    if global_batch == -1:
        return 1
    if global_batch % local:
        per_rank = training.local_batch_size
        sizes = [size for size in range(1, global_batch // per_rank + 1) if global_batch % (per_rank * size) == 0]
        # A resume keeps its checkpoint's batch sizes (changing one is refused): the process count is what it may
        # change.
        other = f"run on a data-parallel size that divides it ({', '.join(map(str, sizes))}), or, " if sizes else ""
        raise ConfigError(
            f"config training.global_batch_size = {global_batch} is not a multiple of local_batch_size x "
            f"data-parallel size = {per_rank} x {dp_world} = {local}; {other}for a new run, choose a multiple (a "
            "resume keeps the batch sizes its checkpoint was trained with)"
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


def to_flags(config: JobConfig) -> list[str]:
    """``config`` as command-line overrides (``--section.key=value``, every key) that :func:`parse_args` reads
    back to an equal config: how a command hands a whole config to the processes it launches."""
    flags = []
    for key in describe_keys():
        section, name = key.dotted.split(".")
        value = getattr(getattr(config, section), name)
        if isinstance(value, list):
            value = ",".join(value)
        elif isinstance(value, bool):
            value = str(value).lower()
        flags.append(f"--{key.dotted}={value}")
    return flags
