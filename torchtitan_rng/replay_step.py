"""The per-rank half of ``python -m torchtitan_rng.replay``: train a run to its last step and observe that step.

    python -m torchtitan_rng.replay_step --job.config_file F [--section.key value ...]

The replay command starts it, with the replay's whole config as flags: on one process as it is, on several under
the package's launcher (torchrun). Each rank trains as the trainer does (``training.steps`` is the observed
step); hooks on the plan and the step note, for that step, each micro-batch's loss and gradient (of its own loss,
per block), the step's gradient per block and the norm of its update. The ranks gather their micro-batches at the
end of the step and rank 0 writes them, in the loss log's order of samples (the plan's slot order), into
:data:`REPORT_NAME` in the dump folder. The observation changes no bit of the step (see :func:`observe`).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchtitan_rng.config import JobConfig, Training, parse_args
from torchtitan_rng.errors import TorchtitanRngError, report
from torchtitan_rng.launch import orphans
from torchtitan_rng.train_spec import Batch, LossFn

if TYPE_CHECKING:
    from torchtitan_rng.parallel import ParallelPlan

REPORT_NAME = "replay_report.json"


def block_of(name: str) -> str:
    """The block a parameter belongs to: its name up to its first index ("layers.3"), or, without one, its
    module ("output", "transformer.img_in")."""
    parts = name.removeprefix("_orig_mod.").split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return ".".join(parts[: index + 1] if index is not None else parts[:-1] or parts)


def block_norms(named: list[tuple[str, torch.Tensor | None]], summed_over_ranks: bool) -> dict[str, float]:
    """The 2-norm of the tensors of each block, in the model's order (a missing gradient: none). A sharded
    tensor adds the squares of its shards over the ranks (``summed_over_ranks``: every rank calls it)."""
    squares: dict[str, list[torch.Tensor]] = {}
    for name, tensor in named:
        if tensor is not None:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            squares.setdefault(block_of(name), []).append(local.detach().double().square().sum())
    if not squares:
        return {}
    sums = torch.stack([torch.stack(parts).sum() for parts in squares.values()])
    if summed_over_ranks:
        dist.all_reduce(sums)
    return {block: float(value.sqrt()) for block, value in zip(squares, sums)}


def total_norm(norms: dict[str, float]) -> float:
    return math.sqrt(sum(value * value for value in norms.values()))


@dataclass
class StepReport:
    """What a replay saw of its target step: per micro-batch (in slot order) its loss, the norms of the gradient of
    its own loss per block and where its samples are in the loss log's ``samples`` (the loader batch's index
    there, and which of how many equal parts of it: pipeline stages split a loader batch into micro-batches),
    the step's gradient per block before clipping, and the norm of its update."""

    losses: list[float] = field(default_factory=list)
    micro_batch_grads: list[dict[str, float]] = field(default_factory=list)
    micro_batch_samples: list[tuple[int, int, int]] = field(default_factory=list)
    step_grads: dict[str, float] = field(default_factory=dict)
    update_norm: float = 0.0


def _graph_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The trained parameters as a step's autograd graph holds them, by name. Under FSDP2 the graph holds the
    unsharded copy each rank gathers (its whole gradient flows there before the reduce-scatter): the
    parameter group's own record of it, as torch exposes no public handle to it."""
    named = {name: p for name, p in model.named_parameters() if p.requires_grad}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else []:
                name = fsdp_param._param_fqn
                if name in named and hasattr(fsdp_param, "_unsharded_param"):
                    named[name] = fsdp_param._unsharded_param
    return list(named.items())


def observe(trainer: Any, step: int) -> StepReport:
    """Hooks on ``trainer``'s plan and step that fill a report of ``step`` (other steps run untouched). Each
    micro-batch's own gradient is one more backward through its retained graph (``autograd.grad``: it writes
    no ``.grad``, reduces nothing over the ranks and draws nothing), so the step's gradients and its update
    stay those of the run."""
    seen, plan, model = StepReport(), trainer.plan, trainer.parts.model
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]  # the trained ones
    sharded = trainer.world.world_size > 1 and any(isinstance(p, DTensor) for _, p in named)
    forward_backward, train_step = plan.forward_backward, trainer._step

    def observed_loss(loss_fn: LossFn) -> LossFn:
        def loss_of(module: nn.Module, batch: Batch, training: Training) -> torch.Tensor:
            loss = loss_fn(module, batch, training)
            graph = _graph_params(model)
            grads = torch.autograd.grad(loss, [p for _, p in graph], retain_graph=True, allow_unused=True)
            seen.losses.append(float(loss.detach()))
            seen.micro_batch_grads.append(block_norms([(name, g) for (name, _), g in zip(graph, grads)], False))
            return loss
        return loss_of

    def observed_forward_backward(module, params, batches, loss_fn, at):  # type: ignore[no-untyped-def]
        if at != step:
            return forward_backward(module, params, batches, loss_fn, at)
        loss = forward_backward(module, params, batches, observed_loss(loss_fn), at)
        seen.step_grads = block_norms([(name, p.grad) for name, p in named], sharded)
        return loss

    def observed_step(at: int, batches: Any) -> dict[str, Any]:
        before = [p.detach().clone() for _, p in named] if at == step else []
        record = train_step(at, batches)
        if before:
            changes = [(name, p.detach() - old) for (name, p), old in zip(named, before)]
            seen.update_norm = total_norm(block_norms(changes, sharded))
            _place_micro_batches(seen, trainer.plan)
            _gather_micro_batches(seen, trainer.world.world_size)
        return record

    plan.forward_backward, trainer._step = observed_forward_backward, observed_step
    return seen


def _place_micro_batches(seen: StepReport, plan: ParallelPlan) -> None:
    """Where this rank's micro-batches are in the loss log's samples: its data shard's loader batch ``i`` is entry
    ``plan.slot(shard, i)``, each split into the same number of micro-batches, in order (a rank that computes no
    loss, a pipeline stage before the last, has none)."""
    loader_batches, shard = plan.micro_batches_per_rank, plan.data_shard[0]
    parts, left = divmod(len(seen.losses), loader_batches)
    assert not left, f"{len(seen.losses)} micro-batch losses from {loader_batches} loader batches"
    seen.micro_batch_samples = [(plan.slot(shard, i // parts), i % parts, parts) for i in range(len(seen.losses))]


def _gather_micro_batches(seen: StepReport, world_size: int) -> None:
    """Every rank's micro-batches into every rank's report, in the loss log's order of samples (by entry, then
    part)."""
    if world_size > 1:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, (seen.losses, seen.micro_batch_grads, seen.micro_batch_samples))
        seen.losses = [loss for losses, _, _ in gathered for loss in losses]
        seen.micro_batch_grads = [grads for _, per_rank, _ in gathered for grads in per_rank]
        seen.micro_batch_samples = [where for _, _, per_rank in gathered for where in per_rank]
    order = sorted(range(len(seen.losses)), key=lambda i: seen.micro_batch_samples[i])
    seen.losses = [seen.losses[i] for i in order]
    seen.micro_batch_grads = [seen.micro_batch_grads[i] for i in order]
    seen.micro_batch_samples = [seen.micro_batch_samples[i] for i in order]


def replay_step(config: JobConfig) -> None:
    """Train ``config`` to its last step, observing it; rank 0 writes the report into the dump folder."""
    from torchtitan_rng.trainer import Trainer

    trainer = Trainer(config)
    try:
        seen = observe(trainer, config.training.steps)
        trainer.train()
    finally:
        trainer.close()
    if trainer.world.rank == 0:
        (trainer.dump_folder / REPORT_NAME).write_text(json.dumps(asdict(seen)))


def main(argv: list[str] | None = None) -> int:
    orphans.die_with_launcher()
    try:
        replay_step(parse_args(sys.argv[1:] if argv is None else argv))
    except TorchtitanRngError as err:
        return report(err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
