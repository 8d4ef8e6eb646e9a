"""Replay one step of a run: ``python -m torchtitan_rng.replay RUN --step K [--processes N]
[--checkpoint.folder W]``.

It resumes the run's newest complete checkpoint before step K (in RUN, or in W: the run's ``checkpoint.folder``, a
URL or a folder) or, when there is none, starts as the run started (afresh, or from the checkpoint its
``checkpoint.initial_load_path`` named), with the values the checkpoint records (not its config file: the replay
runs from any folder), into a temporary dump folder, saving no checkpoint, on N real processes (default: as many as
saved the newest checkpoint; several under the package's launcher, as ``run_train.sh`` starts them), trains to step
K with ``metrics.log_samples`` and prints, for each micro-batch of step K, its sample keys (with their token offsets
when the data is a file of tokens), loss and gradient norm (total and per block), then the step's gradient norm per
block and the norm of its update, and one line: whether the step's loss and gradient norm equal those in RUN's loss
log bit for bit (exit 0 when they do, 1 when not). A world-size-invariant run replays at any process count its
micro-batches divide, without its pipeline stages; an ordinary run only at the count that trained it (another is
refused in one line, exit 2: only that count continues its checkpoints exactly). The ranks' side is
``replay_step.py``; their progress goes to stderr. Loading never executes code: a ``job.custom_module`` the
checkpoint's record names is refused in one line unless the user names the same (``--job.custom_module NAME``), and
``run.json`` and ``.metadata`` are checked against the checkpoint's checksums before they are read.
"""

from __future__ import annotations

from torchtitan_rng.errors import exit_without_torch

if __name__ == "__main__":
    exit_without_torch("replay")  # before the imports below, which need torch: one line, not a traceback

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchtitan_rng.checkpoint import integrity, layout, run_record
from torchtitan_rng.checkpoint.layout import METADATA_NAME, CheckpointInfo
from torchtitan_rng.checkpoint.dcp_io import inspect_checkpoint
from torchtitan_rng.checkpoint.storage import Location, is_url
from torchtitan_rng.config import JobConfig, from_values, to_flags
from torchtitan_rng.errors import CheckpointError, ConfigError, TorchtitanRngError, report
from torchtitan_rng.launch.runs import launch_command
from torchtitan_rng.loss_log import read_loss_log, same_bits
from torchtitan_rng.parallel import mode_of
from torchtitan_rng.replay_step import REPORT_NAME, total_norm
from torchtitan_rng.samples import (FOLDER_HELP, as_launched, format_keys, no_checkpoint, run_checkpoints,
                                    token_offsets)
from torchtitan_rng.sample_log import SAMPLES_FIELD


def _start(checkpoints: list[Location], step: int, trusted_module: str) -> tuple[Location | None, dict[str, Any]]:
    """The newest of the run's ``checkpoints`` before ``step`` (None: none), and the config values to replay:
    its files checked before any value is read, and a ``job.custom_module`` it names refused unless the user
    named the same (``trusted_module``), as loading never executes code a file names."""
    before = [path for path in checkpoints if int(path.name.split("-")[1]) < step]
    chosen = before[-1] if before else None
    record = run_record.read_checked_record(chosen or checkpoints[0])
    if record is None:
        raise ConfigError(f"checkpoint {chosen or checkpoints[0]} holds no run.json: its config is unknown")
    run_record.refuse_untrusted_module(chosen or checkpoints[0], record["config"], trusted_module)
    run_record.refuse_other_llama_layout(chosen or checkpoints[0], record)
    return chosen, record["config"]


def _run_start(values: dict[str, Any], scratch: Path) -> Location | None:
    """The checkpoint the run itself started from (its ``checkpoint.initial_load_path`` and ``load_step``, paths
    as launched: :func:`as_launched`), None when it started afresh; ``scratch``: an empty folder."""
    initial = values.get("checkpoint.initial_load_path") or ""
    if not initial:
        return None
    if not is_url(initial) and not Path(initial).exists():
        raise ConfigError(f"the run started from checkpoint.initial_load_path {initial!r}, which is not there: "
                          "run the replay in the folder the run was launched in")
    return layout.start_location(scratch, values.get("checkpoint.load_step", -1), initial)


def _replayed_values(values: dict[str, Any]) -> dict[str, Any]:
    """The run's config as the replay trains it: the keys the run's mode computes the same bits under whatever
    their value (a world-size-invariant run's pipeline stages) back at their defaults, the replay's processes
    laying the step out their own way."""
    layout = mode_of(from_values(values).parallelism).layout_keys()
    return {key: value for key, value in values.items() if key not in layout}


def _replay_config(values: dict[str, Any], checkpoint: Location | None, step: int, dump: Path) -> JobConfig:
    """The replay's config: the run's, trained from ``checkpoint`` (None: afresh) to ``step`` into ``dump``,
    looking only (no checkpoint saved)."""
    config = from_values(_replayed_values(values))
    config.job.dump_folder = str(dump)
    config.training.steps = step
    config.metrics.log_samples = True
    config.data.num_workers = 0  # the samples are pure functions of their keys: workers change no bit
    ckpt = config.checkpoint
    ckpt.enable, ckpt.folder, ckpt.load_step, ckpt.async_mode = False, "checkpoint", -1, "disabled"
    ckpt.initial_load_path = str(checkpoint) if checkpoint is not None else ""
    return config


def _blocks(norms: dict[str, float]) -> str:
    return "  ".join(f"{block} {value:.6g}" for block, value in norms.items())


def verdict(step: int, replayed: dict[str, Any], logged: dict[str, Any]) -> tuple[bool, str]:
    """Whether the replayed step's loss (and gradient norm, where logged) equal the log's bit for bit, in one
    line."""
    keys = [key for key in ("loss", "grad_norm") if key in logged and key in replayed]
    values = ", ".join(f"{key} {replayed[key]!r}" for key in keys)
    differing = [key for key in keys if not same_bits(replayed[key], logged[key])]
    if not differing:
        return True, f"step {step}: {values}, equal to the run's loss log bit for bit"
    return False, (f"step {step}: {values}, but the run's loss log has "
                   + ", ".join(f"{key} {logged[key]!r} (difference {replayed[key] - logged[key]!r})"
                               for key in differing))


def _refuse_other_counts(info: CheckpointInfo, values: dict[str, Any], processes: int) -> None:
    """``processes`` continue this run's checkpoints (the newest's ``info``) exactly, or the replay is refused
    (its plan says why)."""
    config = from_values(_replayed_values(values))
    plan = mode_of(config.parallelism)
    try:
        plan.check_checkpoint(info, processes, None)
        plan.check_config(config, processes)
    except (CheckpointError, ConfigError) as err:
        raise ConfigError(f"--processes {processes} cannot replay this run exactly ({err}); an ordinary run replays "
                          f"at the count that trained it (--processes {info.saved_world_size}), a "
                          "world-size-invariant one at any count its micro-batches divide") from None


class ReplayFailed(Exception):
    """The replayed run failed; its processes said why (on stderr), and the command exits with their code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _replay_on(config: JobConfig, processes: int) -> dict[str, Any]:
    """Train ``config`` on ``processes`` real processes observing its last step (their output on stderr);
    rank 0's report."""
    command = launch_command("torchtitan_rng.replay_step", to_flags(config), processes)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr, env=env)
    report_file = Path(config.job.dump_folder) / REPORT_NAME
    if done.returncode != 0 or not report_file.is_file():
        raise ReplayFailed(done.returncode or 1)
    return json.loads(report_file.read_text())


@dataclass
class ReplayPlan:
    """A replay checked and ready to launch: the run's step, the checkpoint it starts from (None: the run's start),
    the config values it trains with, on how many processes, and the run's loss log line of the step."""
    step: int
    checkpoint: Location | None
    values: dict[str, Any]
    processes: int
    logged: dict[str, Any]


@dataclass
class Replayed:
    """A step replayed into a dump folder: where it started (in words), its config, rank 0's report
    (replay_step.py) and the replay's loss log line of the step."""
    start: str
    config: JobConfig
    seen: dict[str, Any]
    replayed: dict[str, Any]


def plan_replay(run: Path, step: int, processes: int | None = None, trusted_module: str = "", folder: str = "",
                observe: dict[str, Any] | None = None) -> ReplayPlan:
    """Check that ``step`` of ``run`` can be replayed (see the module's docstring), launching nothing; ``observe``:
    config values (``section.key``) set on top of the run's, for keys that only observe (quiet ones:
    ``debug.tensor_fingerprint``)."""
    if step < 1:
        raise ConfigError(f"--step {step}: steps count from 1")
    if processes is not None and processes < 1:
        raise ConfigError(f"--processes {processes}: at least 1")
    logged = read_loss_log(run)
    if step not in logged:
        raise ConfigError(f"{run}'s loss log has no step {step}: nothing to compare the replay with")
    checkpoints = run_checkpoints(run, folder)
    if not checkpoints:
        raise no_checkpoint(run, folder, "the run's config")
    checkpoint, recorded = _start(checkpoints, step, trusted_module)
    values = {**as_launched(run, recorded), **(observe or {})}
    integrity.verify_files(checkpoints[-1], [METADATA_NAME], integrity.TOOL_ADVICE)  # checked before it is read
    info = inspect_checkpoint(checkpoints[-1])
    processes = processes or info.saved_world_size or 1
    _refuse_other_counts(info, values, processes)
    return ReplayPlan(step, checkpoint, values, processes, logged[step])


def replay_into(plan: ReplayPlan, dump: Path) -> Replayed:
    """Launch ``plan`` into the new dump folder ``dump``; what it saw."""
    run_start = _run_start(plan.values, dump) if plan.checkpoint is None else None
    config = _replay_config(plan.values, plan.checkpoint or run_start, plan.step, dump)
    seen = _replay_on(config, plan.processes)
    start = (f"checkpoint {plan.checkpoint}" if plan.checkpoint is not None
             else f"checkpoint {run_start}, the run's checkpoint.initial_load_path" if run_start is not None
             else "the start (no checkpoint before it)")
    return Replayed(start, config, seen, read_loss_log(dump)[plan.step])


def replay(run: Path, step: int, processes: int | None = None, trusted_module: str = "", folder: str = "") -> int:
    """Replay ``step`` of ``run`` (see the module's docstring) on ``processes`` (None: as many as trained its
    newest checkpoint), from its checkpoints in ``folder`` (its ``checkpoint.folder``; "": in ``run``);
    ``trusted_module``: the user's ``--job.custom_module``, the only module the replay may import."""
    plan = plan_replay(run, step, processes, trusted_module, folder)
    with tempfile.TemporaryDirectory(prefix="replay-") as scratch:
        done = replay_into(plan, Path(scratch) / "replay")
    seen, replayed = done.seen, done.replayed
    offset_of = token_offsets(done.config, trusted_module)
    print(f"replayed step {step} of {run} on {plan.processes} process(es) from {done.start}")
    logged_keys = replayed[SAMPLES_FIELD]
    keys_of = [torch.tensor(logged_keys[entry]).tensor_split(parts)[part].tolist()
               for entry, part, parts in seen["micro_batch_samples"]]
    # Every sample the step loaded is in a printed micro-batch: a plan whose loss the replay did not see fails here.
    assert {key for keys in keys_of for key in keys} == {key for keys in logged_keys for key in keys}, (
        f"the replay saw {len(keys_of)} micro-batches, not all of step {step}'s samples")
    for number, (loss, grads, keys) in enumerate(zip(seen["losses"], seen["micro_batch_grads"], keys_of,
                                                       strict=True)):
        print(f"micro-batch {number}: loss {loss!r}  grad_norm {total_norm(grads):.6g}  samples "
              f"{format_keys(keys, offset_of)}")
        print(f"  grad_norm per block: {_blocks(grads)}")
    skipped = " (skipped: no update)" if replayed.get("skipped") else ""
    print(f"step {step}: grad_norm per block (before clipping): {_blocks(seen['step_grads'])}")
    print(f"step {step}: update norm {seen['update_norm']:.6g}{skipped}")
    equal, line = verdict(step, replayed, plan.logged)
    print(line)
    return 0 if equal else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtitan_rng.replay",
                                     description="Replay one step of a run and compare it with the run's loss log.")
    parser.add_argument("run", type=Path, help="the run's dump folder (job.dump_folder)")
    parser.add_argument("--step", type=int, required=True, help="the step (from 1)")
    parser.add_argument("--processes", type=int, default=None,
                        help="processes to replay on (default: the count that trained the run's newest checkpoint; "
                             "an ordinary run replays only at that count)")
    parser.add_argument("--checkpoint.folder", dest="folder", default="", metavar="WHERE", help=FOLDER_HELP)
    parser.add_argument("--job.custom_module", dest="custom_module", default="", metavar="NAME",
                        help="the module the run was trained with (job.custom_module): a checkpoint's own is "
                             "never imported unless named here")
    args = parser.parse_args(argv)
    try:
        return replay(args.run, args.step, args.processes, args.custom_module, args.folder)
    except TorchtitanRngError as err:
        return report(err)
    except ReplayFailed as err:
        return err.code


if __name__ == "__main__":
    sys.exit(main())
