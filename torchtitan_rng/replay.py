"""Replay one step of a run: ``python -m torchtitan_rng.replay RUN --step K [--processes N]``.

It resumes the run's newest complete checkpoint before step K (or starts it afresh when there is none) with the
config the checkpoint records, into a temporary dump folder, on N real processes (default 1; several under the
package's launcher, as ``run_train.sh`` starts them), trains to step K with ``metrics.log_samples`` and prints,
for each micro-batch of step K, its sample keys (with their token offsets when the data is a file of tokens),
loss and gradient norm (total and per block), then the step's gradient norm per block and the norm of its update,
and one line: whether the step's loss and gradient norm equal those in RUN's loss log bit for bit (exit 0 when
they do, 1 when not). A world-size-invariant run replays at any process count its micro-batches divide, without
its pipeline stages; an ordinary run only at the count that trained it (another is refused in one line, exit 2:
only that count continues its checkpoints exactly). The ranks' side is ``replay_step.py``; their progress goes to
stderr. Loading never executes code: a ``job.custom_module`` the checkpoint's record names is refused in one line
unless the user names the same (``--job.custom_module NAME``), and ``run.json`` and ``.metadata`` are checked
against the checkpoint's checksums before they are read.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from torchtitan_rng.checkpoint import integrity, run_record
from torchtitan_rng.checkpoint.layout import METADATA_NAME
from torchtitan_rng.checkpoint.safe_load import inspect_checkpoint
from torchtitan_rng.compare_losses import same_bits
from torchtitan_rng.config import JobConfig, from_values, to_flags
from torchtitan_rng.errors import CheckpointError, ConfigError, TorchtitanRngError, report
from torchtitan_rng.launch.runs import launch_command
from torchtitan_rng.loss_log import read_loss_log
from torchtitan_rng.parallel import plan_class
from torchtitan_rng.replay_step import REPORT_NAME, total_norm
from torchtitan_rng.samples import format_keys, run_checkpoints, token_offsets
from torchtitan_rng.sample_log import SAMPLES_FIELD


def _start(run: Path, step: int, trusted_module: str) -> tuple[Path | None, dict[str, Any]]:
    """The newest complete checkpoint of ``run`` before ``step`` (None: none), and the config values to replay:
    its files checked before any value is read, and a ``job.custom_module`` it names refused unless the user
    named the same (``trusted_module``), as loading never executes code a file names."""
    checkpoints = run_checkpoints(run) if run.is_dir() else []
    if not checkpoints:
        raise ConfigError(f"{run} holds no complete checkpoint, whose run.json records the run's config; give the "
                          "dump folder of a run trained with --checkpoint.enable")
    before = [path for path in checkpoints if int(path.name.split("-")[1]) < step]
    chosen = before[-1] if before else None
    record = run_record.read_checked_record(chosen or checkpoints[0])
    if record is None:
        raise ConfigError(f"checkpoint {chosen or checkpoints[0]} holds no run.json: its config is unknown")
    run_record.refuse_untrusted_module(chosen or checkpoints[0], record["config"], trusted_module)
    return chosen, record["config"]


def _replayed_values(values: dict[str, Any]) -> dict[str, Any]:
    """The run's config as the replay trains it: the keys the run's mode computes the same bits under whatever
    their value (a world-size-invariant run's pipeline stages) back at their defaults, the replay's processes
    laying the step out their own way."""
    layout = plan_class(from_values(values).parallelism).layout_keys()
    return {key: value for key, value in values.items() if key not in layout}


def _replay_config(values: dict[str, Any], checkpoint: Path | None, step: int, dump: Path) -> JobConfig:
    config = from_values(_replayed_values(values))
    config.job.dump_folder = str(dump)
    config.training.steps = step
    config.metrics.log_samples = True
    config.data.num_workers = 0  # the samples are pure functions of their keys: workers change no bit
    ckpt = config.checkpoint
    ckpt.enable, ckpt.folder, ckpt.load_step, ckpt.keep_latest_k = True, "checkpoint", -1, 1
    ckpt.interval, ckpt.async_mode = step + 1, "disabled"  # only the last step's save, into the temporary folder
    if checkpoint is not None:  # else the run's own start: afresh, or the checkpoint it was started from
        ckpt.initial_load_path = str(checkpoint)
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


def _refuse_other_counts(run: Path, values: dict[str, Any], processes: int) -> None:
    """``processes`` continue this run's checkpoints exactly, or the replay is refused (its plan says why)."""
    newest = run_checkpoints(run)[-1]
    integrity.verify_files(newest, [METADATA_NAME], integrity.TOOL_ADVICE)  # checked before it is read
    config, info = from_values(_replayed_values(values)), inspect_checkpoint(newest)
    plan = plan_class(config.parallelism)
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


def replay(run: Path, step: int, processes: int = 1, trusted_module: str = "") -> int:
    """Replay ``step`` of ``run`` (see the module's docstring); ``trusted_module``: the user's
    ``--job.custom_module``, the only module the replay may import."""
    if step < 1:
        raise ConfigError(f"--step {step}: steps count from 1")
    if processes < 1:
        raise ConfigError(f"--processes {processes}: at least 1")
    logged = read_loss_log(run)
    if step not in logged:
        raise ConfigError(f"{run}'s loss log has no step {step}: nothing to compare the replay with")
    checkpoint, values = _start(run, step, trusted_module)
    _refuse_other_counts(run, values, processes)
    with tempfile.TemporaryDirectory(prefix="replay-") as folder:
        config = _replay_config(values, checkpoint, step, Path(folder))
        seen = _replay_on(config, processes)
        replayed = read_loss_log(Path(folder))[step]
    offset_of = token_offsets(config, trusted_module)
    start = f"checkpoint {checkpoint}" if checkpoint is not None else "the start (no checkpoint before it)"
    print(f"replayed step {step} of {run} on {processes} process(es) from {start}")
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
    equal, line = verdict(step, replayed, logged[step])
    print(line)
    return 0 if equal else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtitan_rng.replay",
                                     description="Replay one step of a run and compare it with the run's loss log.")
    parser.add_argument("run", type=Path, help="the run's dump folder (job.dump_folder)")
    parser.add_argument("--step", type=int, required=True, help="the step (from 1)")
    parser.add_argument("--processes", type=int, default=1,
                        help="processes to replay on (default 1); an ordinary run: the count that trained it")
    parser.add_argument("--job.custom_module", dest="custom_module", default="", metavar="NAME",
                        help="the module the run was trained with (job.custom_module): a checkpoint's own is "
                             "never imported unless named here")
    args = parser.parse_args(argv)
    try:
        return replay(args.run, args.step, args.processes, args.custom_module)
    except TorchtitanRngError as err:
        return report(err)
    except ReplayFailed as err:
        return err.code


if __name__ == "__main__":
    sys.exit(main())
