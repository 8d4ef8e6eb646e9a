"""Replay one step of a run on this one process: ``python -m torchtitan_rng.replay RUN --step K``.

It resumes the run's newest complete checkpoint before step K (or starts it afresh when there is none) with the
config the checkpoint records, into a temporary dump folder, trains to step K with ``metrics.log_samples``, and
prints, for each micro-batch of step K, its sample keys, loss and gradient norm (total and per block), then the
step's gradient norm per block and the norm of its update, and one line: whether the step's loss and gradient
norm equal those in RUN's loss log bit for bit (exit 0 when they do, 1 when not). A world-size-invariant run
replays on one process whatever its process count and pipeline stages; an ordinary run only when one process
trained it (refused in one line otherwise: only the count that saved its checkpoints continues them exactly).
The progress of the replayed steps goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchtitan_rng.checkpoint import run_record
from torchtitan_rng.checkpoint.safe_load import inspect_checkpoint
from torchtitan_rng.compare_losses import same_bits
from torchtitan_rng.config import JobConfig, from_values
from torchtitan_rng.errors import CheckpointError, ConfigError, TorchtitanRngError, report
from torchtitan_rng.loss_log import read_loss_log
from torchtitan_rng.parallel import plan_class
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
    # One process lays the step out its own way: the keys the run's mode computes the same bits under whatever
    # their value (a world-size-invariant run's pipeline stages) go back to their defaults.
    layout = plan_class(from_values(values)).layout_keys()
    config = from_values({key: value for key, value in values.items() if key not in layout})
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


def block_of(name: str) -> str:
    """The block a parameter belongs to: its name up to its first index ("layers.3"), or, without one, its
    module ("output", "transformer.img_in")."""
    parts = name.removeprefix("_orig_mod.").split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return ".".join(parts[: index + 1] if index is not None else parts[:-1] or parts)


def block_norms(named: list[tuple[str, torch.Tensor | None]]) -> dict[str, float]:
    """The 2-norm of the tensors of each block, in the model's order (a missing gradient: none)."""
    squares: dict[str, list[torch.Tensor]] = {}
    for name, tensor in named:
        if tensor is not None:
            squares.setdefault(block_of(name), []).append(tensor.detach().double().square().sum())
    return {block: float(torch.stack(parts).sum().sqrt()) for block, parts in squares.items()}


def _norm(norms: dict[str, float]) -> float:
    return math.sqrt(sum(value * value for value in norms.values()))


@dataclass
class StepReport:
    """What the replay saw of its target step: per micro-batch its loss and gradient (of its own loss, per
    block), the step's gradient per block before clipping, and the norm of the update it applied."""

    losses: list[float] = field(default_factory=list)
    micro_batch_grads: list[dict[str, float]] = field(default_factory=list)
    step_grads: dict[str, float] = field(default_factory=dict)
    update_norm: float = 0.0


def _observe(trainer: Any, step: int) -> StepReport:
    """Hooks on ``trainer``'s plan and step that fill a report of ``step`` (other steps run untouched). Each
    micro-batch's own gradient is one more backward through its retained graph (``autograd.grad``: it
    writes no ``.grad`` and draws nothing), so the step's gradients and its update stay those of the run."""
    seen, plan = StepReport(), trainer.plan
    named = [(name, p) for name, p in trainer.parts.model.named_parameters() if p.requires_grad]  # the trained
    params = [p for _, p in named]
    forward_backward, train_step = plan.forward_backward, trainer._step

    def observed_loss(loss_fn: LossFn) -> LossFn:
        def loss_of(model: torch.nn.Module, batch: Batch, config: JobConfig) -> torch.Tensor:
            loss = loss_fn(model, batch, config)
            grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            seen.losses.append(float(loss.detach()))
            seen.micro_batch_grads.append(block_norms([(name, g) for (name, _), g in zip(named, grads)]))
            return loss
        return loss_of

    def observed_forward_backward(model, params_, batches, loss_fn, at):  # type: ignore[no-untyped-def]
        if at != step:
            return forward_backward(model, params_, batches, loss_fn, at)
        loss = forward_backward(model, params_, batches, observed_loss(loss_fn), at)
        seen.step_grads = block_norms([(name, p.grad) for name, p in named])
        return loss

    def observed_step(at: int, batches: Any) -> dict[str, Any]:
        before = [p.detach().clone() for p in params] if at == step else []
        record = train_step(at, batches)
        if before:
            seen.update_norm = _norm(block_norms([(name, p.detach() - old) for (name, p), old in zip(named, before)]))
        return record

    plan.forward_backward, trainer._step = observed_forward_backward, observed_step
    return seen


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


def _refuse_other_counts(run: Path, values: dict[str, Any]) -> None:
    """One process continues this run's checkpoints exactly, or the replay is refused (its plan says why)."""
    config, info = from_values(values), inspect_checkpoint(run_checkpoints(run)[-1])
    try:
        plan_class(config).check_checkpoint(info, 1, None)
    except CheckpointError as err:
        raise ConfigError(f"replay runs on one process, and one cannot continue this run exactly ({err}); replay "
                          f"runs of {info.saved_world_size} processes in the world-size-invariant mode, or resume this "
                          "one at its count into a new dump folder (--checkpoint.initial_load_path)") from None


def replay(run: Path, step: int) -> int:
    from torchtitan_rng.trainer import Trainer

    if step < 1:
        raise ConfigError(f"--step {step}: steps count from 1")
    logged = read_loss_log(run)
    if step not in logged:
        raise ConfigError(f"{run}'s loss log has no step {step}: nothing to compare the replay with")
    checkpoint, values = _start(run, step)
    _refuse_other_counts(run, values)
    with tempfile.TemporaryDirectory(prefix="replay-") as folder, contextlib.redirect_stdout(sys.stderr):
        trainer = Trainer(_replay_config(values, checkpoint, step, Path(folder)))
        try:
            seen = _observe(trainer, step)
            trainer.train()
        finally:
            trainer.close()
        replayed = read_loss_log(Path(folder))[step]
    start = f"checkpoint {checkpoint}" if checkpoint is not None else "the start (no checkpoint before it)"
    print(f"replayed step {step} of {run} on 1 process from {start}")
    for number, (loss, grads, keys) in enumerate(zip(seen.losses, seen.micro_batch_grads,
                                                       replayed[SAMPLES_FIELD])):
        print(f"micro-batch {number}: loss {loss!r}  grad_norm {_norm(grads):.6g}  samples {' '.join(map(str, keys))}")
        print(f"  grad_norm per block: {_blocks(grads)}")
    skipped = " (skipped: no update)" if replayed.get("skipped") else ""
    print(f"step {step}: grad_norm per block (before clipping): {_blocks(seen.step_grads)}")
    print(f"step {step}: update norm {seen.update_norm:.6g}{skipped}")
    equal, line = verdict(step, replayed, logged[step])
    print(line)
    return 0 if equal else 1


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
