"""Replay one step of a run on this one process: ``python -m torchtitan_rng.replay RUN --step K``.

It resumes the run's newest complete checkpoint before step K (or starts it afresh when there is none) with the
config the checkpoint records, into a temporary dump folder, trains to step K with ``metrics.log_samples``, and
prints each micro-batch of step K (its loss and sample keys) and whether the step's loss equals the one in RUN's
loss log bit for bit (exit 0 when it does, 1 when not). A world-size-invariant run replays on one process whatever
its process count; an ordinary run only when one process trained it (its plan refuses the checkpoint otherwise,
in one line). The progress of the replayed steps goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from torchtitan_rng.checkpoint import run_record
from torchtitan_rng.compare_losses import same_bits
from torchtitan_rng.config import JobConfig, from_values
from torchtitan_rng.errors import ConfigError, TorchtitanRngError, report
from torchtitan_rng.loss_log import read_loss_log
from torchtitan_rng.samples import run_checkpoints
from torchtitan_rng.sample_log import SAMPLES_FIELD
from torchtitan_rng.train_spec import Batch, LossFn


def _start(run: Path, step: int) -> tuple[Path | None, dict[str, Any]]:
    """The newest complete checkpoint of ``run`` before ``step`` (None: none), and the config values to replay."""
    checkpoints = run_checkpoints(run) if run.is_dir() else []
    if not checkpoints:
        raise ConfigError(f"{run} holds no complete checkpoint, whose run.json records the run's config; give the "
                          "dump folder of a run trained with --checkpoint.enable")
    before = [path for path in checkpoints if int(path.name.split("-")[1]) < step]
    chosen = before[-1] if before else None
    record = run_record.read_record(chosen or checkpoints[0])
    if record is None:
        raise ConfigError(f"checkpoint {chosen or checkpoints[0]} holds no run.json: its config is unknown")
    return chosen, record["config"]


def _replay_config(values: dict[str, Any], checkpoint: Path | None, step: int, dump: Path) -> JobConfig:
    config = from_values(values)
    config.job.dump_folder = str(dump)
    config.training.steps = step
    config.metrics.log_samples = True
    config.data.num_workers = 0  # the samples are pure functions of their keys: workers change no bit
    ckpt = config.checkpoint
    ckpt.enable, ckpt.folder, ckpt.load_step, ckpt.keep_latest_k = True, "checkpoint", -1, 1
    ckpt.interval, ckpt.async_mode = step + 1, "disabled"  # only the last step's save, into the temporary folder
    ckpt.initial_load_path = str(checkpoint) if checkpoint is not None else ""
    return config


class _LossRecorder:
    """The run's loss function, noting each micro-batch's loss (the same tensor: nothing else changes)."""

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn = loss_fn
        self.losses: list[torch.Tensor] = []

    def __call__(self, model: torch.nn.Module, batch: Batch, config: JobConfig) -> torch.Tensor:
        loss = self.loss_fn(model, batch, config)
        self.losses.append(loss.detach())
        return loss


def replay(run: Path, step: int) -> int:
    from torchtitan_rng.trainer import Trainer

    if step < 1:
        raise ConfigError(f"--step {step}: steps count from 1")
    logged = read_loss_log(run)
    if step not in logged:
        raise ConfigError(f"{run}'s loss log has no step {step}: nothing to compare the replay with")
    checkpoint, values = _start(run, step)
    with tempfile.TemporaryDirectory(prefix="replay-") as folder, contextlib.redirect_stdout(sys.stderr):
        trainer = Trainer(_replay_config(values, checkpoint, step, Path(folder)))
        try:
            recorder = _LossRecorder(trainer.parts.loss_fn)
            trainer.parts.loss_fn = recorder
            trainer.train()
        finally:
            trainer.close()
        replayed = read_loss_log(Path(folder))[step]
        micro_batches = trainer.plan.micro_batches_per_rank
    losses = [float(loss) for loss in recorder.losses[-micro_batches:]]
    start = f"checkpoint {checkpoint}" if checkpoint is not None else "the start (no checkpoint before it)"
    print(f"replayed step {step} of {run} on 1 process from {start}")
    for number, (loss, keys) in enumerate(zip(losses, replayed[SAMPLES_FIELD])):
        print(f"micro-batch {number}: loss {loss!r}  samples {' '.join(map(str, keys))}")
    loss, want = replayed["loss"], logged[step]["loss"]
    grad_norm = f", grad_norm {replayed['grad_norm']!r}" if "grad_norm" in replayed else ""
    if same_bits(loss, want):
        print(f"step {step}: loss {loss!r}{grad_norm}, equal to the run's loss log bit for bit")
        return 0
    print(f"step {step}: loss {loss!r}{grad_norm}, but the run's loss log has {want!r} (difference {loss - want!r})")
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtitan_rng.replay",
                                     description="Replay one step of a run on this process and compare its loss.")
    parser.add_argument("run", type=Path, help="the run's dump folder (job.dump_folder)")
    parser.add_argument("--step", type=int, required=True, help="the step (from 1)")
    args = parser.parse_args(argv)
    try:
        return replay(args.run, args.step)
    except TorchtitanRngError as err:
        return report(err)


if __name__ == "__main__":
    sys.exit(main())
