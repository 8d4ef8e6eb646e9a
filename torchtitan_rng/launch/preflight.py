"""Checks a run's configuration and checkpoint choice before torchrun starts any process.

    python -m torchtitan_rng.launch.preflight --job.config_file F [overrides]

Exit 0 when the run can start; 2 with one line naming the problem otherwise.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from torchtitan_rng import resume, signals
from torchtitan_rng.checkpoint.layout import complete_steps
from torchtitan_rng.config import Checkpoint, JobConfig, as_flags, parse_args
from torchtitan_rng.diagnosis.fingerprint_files import read_rank_files
from torchtitan_rng.diagnosis.locator import FOLDER as PRINTS_FOLDER
from torchtitan_rng.errors import ConfigError, TorchtitanRngError, report
from torchtitan_rng.loss_log import LossLogError, loss_log_path, read_loss_log_file
from torchtitan_rng.models import get_train_spec
from torchtitan_rng.parallel import mode_of


def check(config: JobConfig, world_size: int | None = None) -> Path | None:
    """Raise a TorchtitanRngError for anything that would stop the run once started; the checkpoint it would
    resume from goes through the one vetting (whole, layout for ``world_size`` when known, files, record).
    Returns that checkpoint (None: a fresh start)."""
    spec = get_train_spec(config)
    signals.signal_numbers(config.signals.checkpoint_on)
    check_dump_folder(Path(config.job.dump_folder))
    resume.signing_of(config.checkpoint)  # a key named but not set: refused before any save or load
    if config.checkpoint.enable:
        resume.folder_of(config).check()  # a bucket that does not exist, a store that does not answer
        resume.check_owner(config)  # another run's checkpoint folder
    if world_size is not None:
        mode_of(config.parallelism).check_config(config, world_size)
    path = resume.checkpoint_to_resume(config)
    if path is None:
        resume.refuse_overwrite(config, 0)  # a resume's saves are checked once its step is loaded
        return None
    # Refusals fail here, before any rank starts; the warnings are rank 0's to print.
    resume.vet_for(config, path, resume.build_record(config, spec.build_dataset(config)), world_size)
    return path


def check_dump_folder(dump: Path) -> None:
    """The dump folder must be a folder (or one that can be created) that this process may write into."""
    existing = next(folder for folder in (dump, *dump.absolute().parents) if folder.exists())
    if not existing.is_dir():
        where = "is a file" if existing == dump else f"is inside {existing}, which is a file"
        raise ConfigError(f"config job.dump_folder = {str(dump)!r} {where}, not a folder: pass --job.dump_folder "
                          "with a folder (an existing run's to resume it, a new one to start)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"config job.dump_folder = {str(dump)!r}: {existing} is not writable (permission denied "
                          "or a read-only filesystem): pass --job.dump_folder with a folder you can write into")


def refuse_restart_over_history(config: JobConfig) -> None:
    """A run that would train from step 1 again and append a second history to the dump folder's loss log is
    refused: one without --checkpoint.enable over a loss log or checkpoints, and one with it that finds no
    checkpoint to resume while the log holds steps past the first save this run makes (so the log is not its
    own, redone after a crash before that save). Resuming is advised only where there is a checkpoint. Nothing
    is ever deleted; a fresh start goes into another dump folder."""
    dump = Path(config.job.dump_folder)
    log = loss_log_path(dump)
    records = _log_to_append_to(log)
    logged = log.is_file() and log.stat().st_size > 0
    # The tensor fingerprints are history too: another run's, left behind, would be read as this run's.
    prints = read_rank_files(dump / PRINTS_FOLDER)
    printed = max(prints[0], default=0) if prints is not None else None
    if config.checkpoint.enable:
        if (logged or printed is not None) and not config.checkpoint.initial_load_path:
            _refuse_new_run_into_log(config, dump, max(records, default=0), printed or 0)
        return
    folder = resume.folder_of(config)
    steps = complete_steps(folder)
    # Checkpoints kept elsewhere (a URL, an absolute folder) are named where they are.
    inside = folder.local is not None and folder.local.resolve().is_relative_to(dump.resolve())
    in_dump = logged or printed is not None
    holder = f"dump folder {dump}" if in_dump or inside else f"checkpoint folder {folder}"
    where = f" in {folder}" if in_dump and not inside else ""
    held = ([log.name] if logged else []) + ([f"{PRINTS_FOLDER}/"] if printed is not None else []) + \
        ([f"checkpoints {', '.join(map(str, steps))}{where}"] if steps else [])
    if held:
        resume_it = "add --checkpoint.enable to resume it, or " if steps else "it holds no checkpoint to resume: "
        raise ConfigError(
            f"{holder} already holds a run ({'; '.join(held)}) and checkpoint.enable is off, so this "
            f"run would start again from step 1 over it: {resume_it}pass another --job.dump_folder (or move this "
            "one away) to start afresh"
        )


def _log_to_append_to(log: Path) -> dict[int, dict[str, Any]]:
    """The records of the loss log this run would append to ({} without one). A log that cannot be read is
    refused: new lines after the damage would leave the whole history unreadable to compare_losses. A last line
    cut by a kill is not damage: the writer drops it."""
    if not log.exists() and not log.is_symlink():
        return {}
    try:
        return read_loss_log_file(log, cut_line_absent=True)
    except LossLogError as err:
        raise LossLogError(f"{err}: this run would append to that log; repair the line or move the log away, then "
                           "run the same command again") from None


def _refuse_new_run_into_log(config: JobConfig, dump: Path, logged: int, printed: int) -> None:
    """With --checkpoint.enable and nothing to resume, a loss log (or tensor fingerprints) past step
    ``checkpoint.interval`` (where this run saves first, and flushes both before) is another run's: appending to
    it would mix two runs, which compare_losses (later lines win) could not tell apart from one. ``logged``,
    ``printed``: the highest step of each (0: none)."""
    if complete_steps(resume.folder_of(config)):
        return  # a resume: it appends to its own history
    last = max(logged, printed)
    what = "a loss log" if logged == last else f"tensor fingerprints ({PRINTS_FOLDER}/)"
    if last > config.checkpoint.interval:
        raise ConfigError(
            f"dump folder {dump} holds {what} up to step {last} and no checkpoint to resume from, so this run "
            "would start again from step 1 and append a second run to that log: pass another --job.dump_folder "
            "(or move this one away) to start afresh"
        )


def how_to_resume(checkpoint: Checkpoint) -> str:
    """The resume instruction that is true for this config (the shipped configs leave checkpointing off)."""
    if checkpoint.enable:
        return "run the same command again to resume"
    return "run the same command again with --checkpoint.enable to resume"


def main(argv: list[str] | None = None) -> int:
    try:
        check(parse_args(sys.argv[1:] if argv is None else argv))
    except TorchtitanRngError as err:
        return report(err, as_flags)
    return 0


if __name__ == "__main__":
    sys.exit(main())
