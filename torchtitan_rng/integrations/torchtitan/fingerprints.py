"""``tensor_fingerprint``: the tensor locator's recorder (``diagnosis/tensor_fingerprints.py``) around torchtitan's
training step, hooked where the loss log hooks it: instance attributes of the trainer, no patch of torchtitan.

torchtitan 0.3's ``train_step`` calls, on every rank and in this order: ``forward_backward_step`` once per
gradient-accumulation group (with the group's micro-batches, on the device; under pipeline parallelism a list of
them), ``clip_grad_norm_``, the optimizer's step, ``metrics_processor.log`` at the steps it logs (after reading the
step's loss and gradient norm to the host), then ``checkpointer.save``. So a step begins at its first
``forward_backward_step``, its gradients are complete (not yet clipped) when the last one returns, its update is done
when ``save`` is called, and the hashes queued before a logged step's loss was read are ready when ``log`` runs:
they are read there, with no host read of their own."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from torchtitan_rng.config import Debug
from torchtitan_rng.diagnosis.tensor_fingerprints import TensorFingerprints
from torchtitan_rng.distributed import rank_and_world_size
from torchtitan_rng.integrations.torchtitan.drift import config_values, horizon_matters, is_quiet


# torch's activation-checkpoint wrapper (torchtitan wraps each layer) inserts this into every name below it; the
# locator names tensors and modules as the model defines them (its state dict's names).
_WRAPPED = "_checkpoint_wrapped_module"


def _unwrapped(name: str) -> str:
    return name.replace(f"{_WRAPPED}.", "").removesuffix(f".{_WRAPPED}")


class _ModelParts(nn.Module):
    """A rank's model parts (one, or several pipeline stages of one schedule) as the recorder's model: each
    parameter and module under its name in the whole model (a stage keeps the whole model's names), without the
    activation-checkpoint wrapper's part (the wrapper's call stands for its module's, with the same inputs and
    outputs)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        for part in self.parts:
            for name, param in part.named_parameters(*args, **kwargs):
                yield _unwrapped(name), param

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        for part in self.parts:
            for name, module in part.named_modules(*args, **kwargs):
                if not name.endswith(_WRAPPED):
                    yield _unwrapped(name), module


class _OptimizerStates:
    """torchtitan's optimizers container as the recorder reads it: the state of every optimizer it holds (one per
    model part and parameter group; the container's own ``state`` stays empty)."""

    def __init__(self, container: Any) -> None:
        self.container = container

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        return {param: state for optimizer in self.container.optimizers for param, state in optimizer.state.items()}


def _micro_batches(input_dict: Any, labels: Any) -> list[dict[str, Any]]:
    """The micro-batches of one ``forward_backward_step`` call, each as one table (its inputs and ``labels``)."""
    if isinstance(input_dict, list):
        return [{**inputs, "labels": label} for inputs, label in zip(input_dict, labels)]
    return [{**input_dict, "labels": labels}]


def _skip_metadata_inference(prints: TensorFingerprints, schedule: Any) -> None:
    """Leave out of the module calls those of torch's pipeline metadata inference: at a process's first step each
    stage runs its forward and backward once to learn the shapes it sends, after the first stage on empty tensors
    (memory never written, so its bits differ from run to run; the backward recomputes checkpointed layers). Done
    by torch's stage, hence its private methods; a torch without them has nothing to leave out."""
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    for stage in stages:
        for method in ("_forward_metadata_inference", "_backward_metadata_inference"):
            infer = getattr(stage, method, None)
            if infer is not None:
                setattr(stage, method, _without_module_calls(prints, infer))


def _without_module_calls(prints: TensorFingerprints, run: Any) -> Any:
    """``run``, its module calls taken back out of the step's record."""
    def run_unrecorded(*args: Any, **kwargs: Any) -> Any:
        calls = prints.record.get("modules")
        before = len(calls) if calls is not None else 0
        try:
            return run(*args, **kwargs)
        finally:
            if calls is not None:
                del calls[before:]
    return run_unrecorded


def attach_tensor_fingerprints(trainer: Any, debug: Debug) -> TensorFingerprints:
    """The recorder of this rank, writing into ``{dump_folder}/tensor_fingerprints/rank{R}.jsonl``, hooked into the
    trainer's ``forward_backward_step`` (each micro-batch, its loss before any reduction over the ranks, the
    gradients after the step's last one) and ``metrics_processor.log`` (the queued hashes read); the caller records
    the update at the checkpointer's ``save`` (:meth:`TensorFingerprints.updated`). Rank 0 records the run's config
    (the keys that can change the losses), which the locator names where two runs' differ."""
    rank, world_size = rank_and_world_size()
    values = config_values(trainer.config)
    config = {key: value for key, value in values.items()
              if not is_quiet(key) or (key == "training.steps" and horizon_matters(values))}
    prints = TensorFingerprints(debug, _ModelParts(trainer.model_parts),
                                _OptimizerStates(trainer.optimizers),  # type: ignore[arg-type]
                                rank=rank, world_size=world_size, dump_folder=Path(trainer.config.dump_folder),
                                config=config)
    forward_backward = trainer.forward_backward_step
    accumulation = trainer.gradient_accumulation_steps

    def recorded_step(*args: Any, **kwargs: Any) -> torch.Tensor:
        if prints.record.get("step") != trainer.step:  # the step's first group
            prints.step_begin(trainer.step)
        for batch in _micro_batches(kwargs["input_dict"], kwargs["labels"]):
            prints.batch(batch)
        loss = forward_backward(*args, **kwargs)
        prints.loss(loss.detach())  # this rank's, before any reduction (a non-last pipeline stage's: its -1)
        if len(prints.record["loss"]) == accumulation:
            prints.gradients()  # before clip_grad_norm_
        return loss

    processor = trainer.metrics_processor
    log = processor.log

    def log_after_reading(*args: Any, **kwargs: Any) -> Any:
        prints.flush()  # queued before this step's loss was read to the host: ready, no wait
        return log(*args, **kwargs)

    if debug.fingerprint_modules_at_step and trainer.parallel_dims.pp_enabled:
        _skip_metadata_inference(prints, trainer.pp_schedule)
    # The instances' attributes, as the loss log replaces the processor's log: the trainer calls them through self.
    trainer.forward_backward_step = recorded_step
    processor.log = log_after_reading
    return prints
