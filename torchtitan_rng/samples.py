"""Which samples made step K of a run: ``python -m torchtitan_rng.samples RUN --step K [--json]``.

Nothing is trained or loaded but JSON, checkpoint metadata and (for token offsets) the data file: a map-style
run's order is a function of its seed, epoch and position (``data/sampler.py`` ``epoch_order``), so the keys of
every micro-batch of a step follow from the config its checkpoints record (``run.json``), the number of samples
per epoch (recorded with the data) and, in the ordinary mode, the process count that saved them. The output is
what ``metrics.log_samples`` writes in the loss log: one list of keys per micro-batch, in slot order (the one
numbering of micro-batches, also ``replay``'s: shard-major, in the world-size-invariant mode the mode's slot); a key is
``epoch * samples_per_epoch + index``. When the data is a file of tokens (``training.dataset_path``: ``.bin``,
``.jsonl``, text), each key is printed with the offset of the sample's first token in it (``KEY@OFFSET``), also a
function of the seed and the key.

What it cannot answer it refuses in one line (exit 2): a run without a checkpoint (no record of its config), a
streaming source (no index), checkpoints that disagree on what sets the order, a ``run.json`` or ``.metadata``
that fails its checksums (read only after the check). The module a record names (``job.custom_module``) is
imported, for the token offsets, only when the user names it too (``--job.custom_module NAME``).
"""

from __future__ import annotations

from torchtitan_rng.errors import exit_without_torch

if __name__ == "__main__":
    exit_without_torch("samples")  # before the imports below, which need torch: one line, not a traceback

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from torchtitan_rng.checkpoint import layout, run_record
from torchtitan_rng.checkpoint.dcp_io import inspect_checkpoint
from torchtitan_rng.checkpoint.storage import Location, checkpoint_folder, is_url
from torchtitan_rng.config import JobConfig, from_values
from torchtitan_rng.errors import ConfigError, TorchtitanRngError, report
from torchtitan_rng.models import get_train_spec
from torchtitan_rng.parallel import mode_of

# What sets the order of a map-style run's samples: every checkpoint of the run must agree on these.
_ORDER_KEYS = ("debug.seed", "training.local_batch_size", "training.global_batch_size", "data.num_samples",
               "parallelism.world_size_invariant", "data.streaming", "model.name")


FOLDER_HELP = ("the run's checkpoint.folder when it was not the default: a URL (s3://bucket/prefix) or a folder "
               "(relative: under RUN)")


def run_checkpoints(run: Path, folder: str = "") -> list[Location]:
    """The complete checkpoints of the run: in ``folder`` (its ``checkpoint.folder``: a URL, or a path under
    ``run``) when given, else in any folder of ``step-N`` folders in the dump folder ``run``."""
    if folder:
        where = checkpoint_folder(run, folder)
        return [layout.step_location(where, step) for step in layout.complete_steps(where)]
    found: list[Location] = []
    for candidate in sorted(path for path in [run, *run.iterdir()] if path.is_dir()) if run.is_dir() else []:
        found += [layout.step_location(candidate, step) for step in layout.complete_steps(candidate)]
    return found


def no_checkpoint(run: Path, folder: str, what: str) -> ConfigError:
    """The refusal of a run without a complete checkpoint where the tool looked (``what``: what it needs)."""
    where = f"{checkpoint_folder(run, folder)} holds" if folder else f"{run} holds"
    return ConfigError(f"{where} no complete checkpoint, whose {run_record.RECORD_NAME} records {what}; give the "
                       "dump folder of a run trained with --checkpoint.enable, and --checkpoint.folder URL when its "
                       "checkpoints went elsewhere (a checkpoint.folder such as s3://bucket/prefix)")


# Recorded values that are paths relative to the folder the run was launched in.
_LAUNCH_RELATIVE = ("training.dataset_path", "checkpoint.initial_load_path")


def launch_folder(run: Path, values: dict[str, Any]) -> Path | None:
    """The folder the run was launched in, where its relative paths point: ``run`` less its recorded
    ``job.dump_folder`` when that was relative and ``run`` ends with it (None: not known)."""
    recorded = Path(values.get("job.dump_folder") or ".")
    parts = run.resolve().parts
    if recorded.is_absolute() or not recorded.parts or parts[-len(recorded.parts):] != recorded.parts:
        return None
    return Path(*parts[:-len(recorded.parts)])


def as_launched(run: Path, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` readable from any folder: no ``job.config_file`` (every value is in the record; the file, named
    relative to where the run was launched, need not be here), and the relative paths the run was launched with
    made absolute where that folder is known."""
    base = launch_folder(run, values)
    values = {**values, "job.config_file": ""}
    for key in _LAUNCH_RELATIVE:
        path = values.get(key) or ""
        if base is not None and path and not is_url(path) and not Path(path).is_absolute():
            values[key] = str(base / path)
    return values


def _order_of(checkpoint: Location) -> tuple[dict[str, Any], Any, int | None]:
    record = run_record.read_checked_record(checkpoint)  # checked before any value is read
    if record is None:
        raise ConfigError(f"checkpoint {checkpoint} holds no {run_record.RECORD_NAME} (saved by an older version): "
                          "the config that orders its samples is unknown")
    return record["config"], record.get("data"), inspect_checkpoint(checkpoint).saved_world_size


def step_samples(run: Path, step: int, folder: str = "") -> tuple[list[list[int]], int, int, JobConfig]:
    """(keys of each micro-batch of ``step``, samples per epoch, processes, the config) of the run in dump folder
    ``run``, whose checkpoints are in ``folder`` (its ``checkpoint.folder``) when given."""
    if not run.is_dir() and not folder:
        raise ConfigError(f"{run} is not a folder; give the run's dump folder (job.dump_folder)")
    if step < 1:
        raise ConfigError(f"--step {step}: steps count from 1")
    checkpoints = run_checkpoints(run, folder)
    if not checkpoints:
        raise no_checkpoint(run, folder, "the config that orders the samples (or read the keys that "
                            "--metrics.log_samples wrote into the loss log)")
    orders = [(checkpoint, *_order_of(checkpoint)) for checkpoint in checkpoints]
    newest, values, data, world_size = orders[-1]
    mode = mode_of(from_values(values).parallelism)
    for checkpoint, other, other_data, other_world in orders[:-1]:
        differing = [key for key in _ORDER_KEYS if other.get(key) != values.get(key)]
        if other_data != data:
            differing.append("the data")
        if other_world != world_size and not mode.any_process_count:
            differing.append(f"the process count ({other_world}, then {world_size})")
        if differing:
            raise ConfigError(f"checkpoints {checkpoint} and {newest} differ in {', '.join(differing)}: the order of "
                              "the samples changed during the run and cannot be rebuilt from its record")
    if values.get("data.streaming"):
        raise ConfigError("this run reads a streaming source (data.streaming): its samples have no index to list; "
                          "the order follows from the file and its shuffle buffers, not from the config")
    if "dataloader" in (values.get("checkpoint.exclude_from_loading") or []):
        raise ConfigError(f"checkpoint {newest} was resumed without its dataloader (checkpoint.exclude_from_loading): "
                          "the data position was reset then and cannot be rebuilt from the record")
    # The count that trained the step (a world-size-invariant run may be resumed at another): that of the first
    # checkpoint at or after it, the run having gone on with the newest's after that.
    world_size = next((count for checkpoint, _, _, count in orders if int(checkpoint.name.split("-")[1]) >= step),
                      world_size)
    num_samples = (data or {}).get("samples")
    if not isinstance(num_samples, int) or world_size is None:
        raise ConfigError(f"checkpoint {newest} does not record its samples per epoch and process count")
    config = from_values(as_launched(run, values))
    keys = mode_of(config.parallelism).step_sample_keys(config, num_samples, world_size, step)
    return keys, num_samples, world_size, config


def token_offsets(config: JobConfig, trusted_module: str = "") -> Callable[[int], int] | None:
    """Where each sample (by key) starts in the tokens of the run's data file; None when the data is no file
    of tokens, or the file cannot be read here (said on stderr: the keys do not need it). ``config`` comes from
    a record: its ``job.custom_module`` is imported only when it is ``trusted_module`` (the user's
    ``--job.custom_module``); another is named on stderr, not imported."""
    if not config.training.dataset_path or config.data.streaming:
        return None
    untrusted = run_record.untrusted_module({run_record.CODE_KEY: config.job.custom_module}, trusted_module)
    if untrusted:
        print(f"note: no token offsets: {run_record.trust_hint('this run', untrusted)}", file=sys.stderr)
        return None
    try:
        dataset = get_train_spec(config).build_dataset(config)
    except ConfigError as err:
        print(f"note: no token offsets: {err}", file=sys.stderr)
        return None
    return getattr(dataset, "token_offset", None)


def format_keys(keys: list[int], offset_of: Callable[[int], int] | None) -> str:
    """A micro-batch's keys, each with its token offset (``KEY@OFFSET``) when the data has them."""
    return " ".join(f"{key}@{offset_of(key)}" if offset_of is not None else str(key) for key in keys)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtitan_rng.samples",
                                     description="Print the sample keys of every micro-batch of a step of a run.")
    parser.add_argument("run", type=Path, help="the run's dump folder (job.dump_folder)")
    parser.add_argument("--step", type=int, required=True, help="the step (from 1)")
    parser.add_argument("--checkpoint.folder", dest="folder", default="", metavar="WHERE", help=FOLDER_HELP)
    parser.add_argument("--json", action="store_true", help="one JSON object: {\"step\": K, \"samples\": [...]}")
    parser.add_argument("--job.custom_module", dest="custom_module", default="", metavar="NAME",
                        help="the module the run was trained with (job.custom_module), imported for the token "
                             "offsets: a checkpoint's own is never imported unless named here")
    args = parser.parse_args(argv)
    try:
        keys, num_samples, world_size, config = step_samples(args.run, args.step, args.folder)
    except TorchtitanRngError as err:
        return report(err)
    offset_of = token_offsets(config, args.custom_module)
    if args.json:
        offsets = {"token_offsets": [[offset_of(key) for key in batch] for batch in keys]} if offset_of else {}
        print(json.dumps({"step": args.step, "samples": keys, **offsets}))
        return 0
    print(f"step {args.step} of {args.run}: {len(keys)} micro-batch(es) of {len(keys[0])} samples, in slot order, "
          f"trained on {world_size} process(es) (key = epoch * {num_samples} + index)")
    if offset_of is not None:
        print(f"KEY@OFFSET: the sample's first token is token OFFSET of {config.training.dataset_path}")
    for number, batch in enumerate(keys):
        print(f"micro-batch {number}: {format_keys(batch, offset_of)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
