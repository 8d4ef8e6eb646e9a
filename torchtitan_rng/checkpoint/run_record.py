"""The run record: what a checkpoint was trained with, and whether a resume may change it.

Every checkpoint holds ``run.json`` (rank 0 writes it into ``step-N.partial`` before the rename): the
run's resolved config (every key), a fingerprint of its data and the versions that trained it. A JSON
file rather than a DCP item: preflight and people read it without torch, it is never unpickled, and DCP's
one-copy-per-key rule does not apply to it.

On resume every difference of the *resolved* values is classified. ``lr_scheduler.total_steps = 0``
means ``training.steps``, so the horizon is compared, not the spelling: stopping with ``--training.steps
10 --lr_scheduler.total_steps 20`` and resuming with ``--training.steps 20`` changes nothing.

* Quiet: keys that cannot change the trajectory (``QUIET``).
* Named: keys a resume may change with a note (``NAMED``), e.g. ``training.skip_steps``.
* Refused by default: every other key, and the data's content. One line per key (saved and new value,
  what to do); ``checkpoint.allow_config_change KEY,...`` turns a key's refusal into a WARNING.
* A checkpoint without ``run.json`` (an older version): a WARNING, resumed as before.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Sequence

from torchtitan_rng.checkpoint import integrity
from torchtitan_rng.checkpoint.layout import METADATA_NAME, RECORD_NAME
from torchtitan_rng.checkpoint.storage import Where, locate
from torchtitan_rng.errors import ConfigError, TorchtitanRngError

# 2: the trainer's Llama keeps each head's q, k and v rows of attn.qkv together (tensor parallelism splits by head);
# format 1 kept all queries, then all keys, then all values, which load into the same shapes as other heads' rows.
_FORMAT = 2


def introduced(saved_config: dict[str, Any]) -> dict[str, Any]:
    """Keys added after records of format 1, with the value that gives what a run recorded without them computed
    (the chunks only where they change the numbers: the world-size-invariant mode)."""
    values: dict[str, Any] = {"parallelism.tensor_parallel_degree": 1}
    if saved_config.get("parallelism.world_size_invariant"):
        values["parallelism.tensor_parallel_chunks"] = 1
    return values


# Keys (or whole sections, "name.*") that cannot change the losses of the steps a resume trains.
QUIET = (
    "job.config_file", "job.dump_folder", "job.description",
    "checkpoint.*",  # where and how often to save, what to load: the resume's own policy
    "metrics.*", "signals.*",
    "validation.*",  # runs inside a preserved-RNG block, after the step's loss is taken
    "training.steps",  # only where training ends; the horizon is compared as lr_scheduler.total_steps
    # Per-sample data randomness does not depend on workers; a worker-RNG dataset has its own policy
    # (data.on_num_workers_change).
    "data.num_workers", "data.prefetch_factor", "data.snapshot_every_n_steps", "data.on_num_workers_change",
    "dataloader.num_workers",  # ExactResume's loader: the same policy as data.num_workers
    "data.capture_worker_rng",  # like checkpoint.restore_rng: switched off only to see what breaks
    "debug.rng_fingerprint", "debug.perturb_rng",  # observation, and deliberate fault injection
    # Observation: hashes, hooks that change nothing.
    "debug.tensor_fingerprint", "debug.fingerprint_modules_at_step", "debug.fingerprint_optimizer_every_step",
)
# Keys whose change a resume names (a note) instead of refusing: the change is what the user came to make, and
# the resumed steps are then exactly those of a run launched with the new value (why, for each).
NAMED = {
    "training.skip_steps": "steps after the checkpoint are skipped as in a run launched with this value",
}
# Compared through the data fingerprint: the same file under another path changes nothing.
_DATA_KEY = "training.dataset_path"
HORIZON_KEY = "lr_scheduler.total_steps"  # compared resolved (0 means training.steps)


class ConfigDriftError(TorchtitanRngError, ValueError):
    """A resume with changed trajectory keys; the message has one line per key."""


def project_version() -> str:
    try:
        return metadata.version("torchtitan_rng")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def make_record(values: dict[str, Any], data: dict[str, Any] | None) -> dict[str, Any]:
    """A record of ``values`` (``section.key``: a JSON value) and a data fingerprint (the trainer's come from its
    config, ``resume.build_record``; ExactResume builds its own). JSON round-trip: a tuple compares equal to the list it is read back as."""
    import torch  # only a training process, which has torch loaded, builds a record

    return {
        "format": _FORMAT,
        "config": json.loads(json.dumps(values, sort_keys=True)),
        "data": data,
        "versions": {"torchtitan_rng": project_version(), "torch": torch.__version__,
                     "python": platform.python_version()},
    }


def write_record(folder: Where, record: dict[str, Any]) -> None:
    (locate(folder) / RECORD_NAME).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def read_record(checkpoint: Where) -> dict[str, Any] | None:
    """The record of a checkpoint, None when it has none (saved by an older version)."""
    path = locate(checkpoint) / RECORD_NAME
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        raise ConfigDriftError(f"checkpoint {checkpoint}: {RECORD_NAME} is damaged (not the JSON this trainer "
                               f"writes); {integrity.RESUME_ADVICE}")
    if not isinstance(record.get("format", 1), int) or record.get("format", 1) > _FORMAT:
        raise ConfigDriftError(f"checkpoint {checkpoint}: {RECORD_NAME} has format {record.get('format')!r}, newer "
                               f"than this torchtitan_rng reads ({_FORMAT}); resume it with the version that saved it "
                               f"({(record.get('versions') or {}).get('torchtitan_rng', 'unknown')})")
    return record


def refuse_other_llama_layout(checkpoint: Where, record: dict[str, Any]) -> None:
    """ConfigDriftError for a Llama checkpoint of the trainer whose record predates format 2: its attn.qkv rows
    are laid out as all queries, keys, values, and would load, with no error, into other heads."""
    if record.get("format", 1) < 2 and record["config"].get("model.name") == "llama":
        version = (record.get("versions") or {}).get("torchtitan_rng", "unknown")
        raise ConfigDriftError(f"checkpoint {checkpoint} was saved by torchtitan_rng {version}, whose Llama lays out "
                               "attn.qkv as all queries, then keys, then values; this version keeps each head's "
                               "rows together, so the weights would load into other heads: finish that run with "
                               f"torchtitan_rng {version}")


def read_checked_record(checkpoint: Where) -> dict[str, Any] | None:
    """:func:`read_record` for a tool that reads a checkpoint without loading it (``samples``, ``replay``): its
    ``run.json`` and ``.metadata`` checked against ``checksums.json`` first, so a damaged record is refused,
    never answered from."""
    integrity.verify_files(checkpoint, [RECORD_NAME, METADATA_NAME], integrity.TOOL_ADVICE)
    return read_record(checkpoint)


CODE_KEY = "job.custom_module"  # the one key whose value is code to import


def untrusted_module(values: dict[str, Any], named: str) -> str:
    """The module a checkpoint's record names that the user did not name (``named``: their
    ``--job.custom_module``), "" when none: loading never executes code a file names, only what the user
    names on their command line."""
    recorded = values.get(CODE_KEY) or ""
    return recorded if isinstance(recorded, str) and recorded and recorded != named else ""


def refuse_untrusted_module(checkpoint: Where, values: dict[str, Any], named: str) -> None:
    """ConfigError when the record names a module the user did not (see :func:`untrusted_module`)."""
    module = untrusted_module(values, named)
    if module:
        raise ConfigError(trust_hint(f"checkpoint {checkpoint}", module))


def trust_hint(trained: str, module: str) -> str:
    """What to do about a module ``trained`` ("checkpoint X", "this run") names, in one line."""
    return (f"{trained} was trained with {CODE_KEY} {module!r}, code that is imported only when "
            f"you name it: pass --{CODE_KEY} {module} if you trust it")


def is_quiet(key: str) -> bool:
    return key in QUIET or f"{key.split('.')[0]}.*" in QUIET


@dataclass(frozen=True)
class Change:
    key: str
    saved: Any
    new: Any
    # What changed, when "KEY = NEW but the checkpoint was trained with SAVED" does not say it.
    what: str = ""

    def describe(self, checkpoint: Where) -> str:
        return (self.what.format(checkpoint=checkpoint) if self.what else
                f"{self.key} = {self.new!r} but checkpoint {checkpoint} was trained with {self.saved!r}")


# A run's parallel mode's view of a record's config (``section.key``: value), as it compares them: the keys that do
# not change its bits left out, the layout as it runs (the parallel plan's ``Mode.compared``).
Compared = Callable[[dict[str, Any]], dict[str, Any]]


def differences(saved: dict[str, Any], current: dict[str, Any], compared: Compared | None = None) -> list[Change]:
    """The trajectory keys whose resolved value differs (quiet keys left out; both configs seen through the run's
    parallel mode, ``compared``, when given), in key order. A key only one side has (added or removed by another
    version, or left out by ``compared``) is not compared: the record cannot say its old value, unless this version
    knows what a record without it ran (:func:`introduced`)."""
    saved_config, config = {**introduced(saved["config"]), **saved["config"]}, current["config"]
    if compared is not None:
        saved_config, config = compared(saved_config), compared(config)
    changes = [Change(key, saved_config[key], config[key]) for key in sorted(set(saved_config) & set(config))
               if key != _DATA_KEY and not is_quiet(key) and saved_config[key] != config[key]]
    steps, horizon = config.get("training.steps", 0), config.get(HORIZON_KEY, 0)
    ran_past_before = saved_config.get("training.steps", 0) > saved_config.get(HORIZON_KEY, 0)
    if horizon == saved_config.get(HORIZON_KEY) and steps > horizon and not ran_past_before:
        changes.append(Change(HORIZON_KEY, horizon, horizon, what=(
            f"training.steps = {steps} runs past lr_scheduler.total_steps = {horizon}, the horizon checkpoint "
            f"{{checkpoint}} was trained with (steps {horizon + 1}-{steps} would train at the schedule's final "
            "learning rate)")))
    if saved.get("data") != current["data"]:
        before, now = saved.get("data"), current["data"]
        changes.append(Change(_DATA_KEY, before, now, what=(
            f"{_DATA_KEY} = {config.get(_DATA_KEY)!r} is other data than checkpoint {{checkpoint}} was trained with "
            f"(saved: {_describe_data(saved_config.get(_DATA_KEY), before)}; now: "
            f"{_describe_data(config.get(_DATA_KEY), now)})")))
        changes.sort(key=lambda change: change.key)
    return changes


def _describe_data(path: Any, fingerprint: Any) -> str:
    source = repr(path) if path else "the built-in text"
    if not isinstance(fingerprint, dict):
        return f"{source}, no fingerprint"
    return ", ".join([source, *(f"{key} {value}" for key, value in sorted(fingerprint.items()))])


@dataclass(frozen=True)
class OptIn:
    """How a refused key is let through: its name in the messages, and which keys an allowed list names."""

    name: str = "checkpoint.allow_config_change"
    how: str = "--checkpoint.allow_config_change {key}"  # what to pass, in the refusal

    def allows(self, key: str, allowed: Sequence[str]) -> bool:
        return key in allowed


def check_resume(checkpoint: Where, saved: dict[str, Any] | None, current: dict[str, Any],
                 allowed: Sequence[str], opt_in: OptIn = OptIn(), compared: Compared | None = None) -> list[str]:
    """Warnings to print for a resume that may go on; raises ConfigDriftError for refused changes.
    ``compared``: the run's parallel mode's view of a config (see :func:`differences`)."""
    if saved is None:
        return [f"WARNING: checkpoint {checkpoint} holds no {RECORD_NAME} (saved by an older version): the config "
                "it was trained with is unknown, so a changed key cannot be detected"]
    refuse_other_llama_layout(checkpoint, saved)
    warnings: list[str] = []
    refused: list[str] = []
    for change in differences(saved, current, compared):
        if change.key in NAMED:
            warnings.append(f"note: {change.describe(checkpoint)}; going on with the new value: {NAMED[change.key]}")
        elif opt_in.allows(change.key, allowed):
            warnings.append(f"WARNING: {change.describe(checkpoint)}; going on as {opt_in.name} "
                            f"allows {change.key}: this run is no longer the one that was stopped")
        else:
            refused.append(f"{change.describe(checkpoint)}: resume with the saved value, or pass "
                           f"{opt_in.how.format(key=change.key)} to continue with the new one (the run is "
                           "then no longer exact)")
    if refused:
        raise ConfigDriftError("\nerror: ".join(refused))
    saved_versions = saved.get("versions") or {}
    # Named, not refused: another Python reads the same checkpoint (its pickles are checked form by form), and
    # another torch may compute other bits, which the user should know when comparing logs.
    moved = [f"{name} {saved_versions.get(name)} (this is {now})" for name, now in current["versions"].items()
             if saved_versions.get(name) != now]
    if moved:
        warnings.append(f"note: checkpoint {checkpoint} was saved by {', '.join(moved)}")
    return warnings
