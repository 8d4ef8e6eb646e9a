"""What a run checkpoints: model and optimizer as DCP Statefuls, and the one function that assembles the
named parts (the trainer, ``ExactResume`` and the benchmarks all build their checkpoint with it)."""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torchtitan_rng.checkpoint import layout


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class ModelState:
    """The model's (possibly FSDP-sharded) weights as a Stateful, via DCP's state_dict helpers."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState:
    """The optimizer keyed by parameter names (flattened), so DCP can reshard it."""

    _options = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer, options=self._options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=self._options)


def checkpoint_parts(*, model: nn.Module, train_state: Stateful, optimizer: torch.optim.Optimizer | None = None,
                     lr_scheduler: Stateful | None = None, dataloader: Stateful | None = None,
                     extras: Mapping[str, Stateful] | None = None) -> dict[str, Stateful]:
    """``{part name: Stateful}`` in load order: the lr scheduler after the optimizer (it sets the
    optimizer's lr from the config's schedule), the train state last."""
    parts: dict[str, Stateful] = {layout.MODEL: ModelState(model)}
    if optimizer is not None:
        parts[layout.OPTIMIZER] = OptimizerState(model, optimizer)
    if lr_scheduler is not None:
        parts[layout.LR_SCHEDULER] = lr_scheduler
    if dataloader is not None:
        parts[layout.DATALOADER] = dataloader
    parts[layout.TRAIN_STATE] = train_state
    for name, part in (extras or {}).items():
        if name in parts or name in layout.PARTS:
            raise ValueError(f"extra part {name!r} clashes with a built-in part; built-in: {', '.join(layout.PARTS)}")
        parts[name] = part
    return parts
