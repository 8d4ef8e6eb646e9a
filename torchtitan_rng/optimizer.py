"""The optimizer named in ``[optimizer]``, over the trainable parameters only."""

from __future__ import annotations

from typing import Iterable

import torch

from torchtitan_rng.config import Optimizer


def _hyperparameters(opt: Optimizer) -> dict[str, object]:
    if opt.name == "SGD":
        return {"weight_decay": opt.weight_decay}
    return {"betas": (opt.beta1, opt.beta2), "eps": opt.eps, "weight_decay": opt.weight_decay}


def hyperparameters_from_config(optimizer: torch.optim.Optimizer, opt: Optimizer) -> None:
    """After a load the param groups hold the checkpoint's hyperparameters; the config's apply (equal
    unless checkpoint.allow_config_change let one change). The learning rate is the scheduler's."""
    for group in optimizer.param_groups:
        group.update(_hyperparameters(opt))


def build_optimizer(params: Iterable[torch.nn.Parameter], opt: Optimizer) -> torch.optim.Optimizer:
    if opt.name == "SGD":
        return torch.optim.SGD(params, lr=opt.lr, **_hyperparameters(opt))
    optimizer_class = torch.optim.AdamW if opt.name == "AdamW" else torch.optim.Adam
    return optimizer_class(params, lr=opt.lr, **_hyperparameters(opt))
