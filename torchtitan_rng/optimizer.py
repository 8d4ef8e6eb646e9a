"""The optimizer named in ``[optimizer]``, over the trainable parameters only."""

from __future__ import annotations

from typing import Iterable

import torch

from torchtitan_rng.config import JobConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], config: JobConfig) -> torch.optim.Optimizer:
    opt = config.optimizer
    if opt.name == "SGD":
        return torch.optim.SGD(params, lr=opt.lr, weight_decay=opt.weight_decay)
    optimizer_class = torch.optim.AdamW if opt.name == "AdamW" else torch.optim.Adam
    return optimizer_class(params, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                           weight_decay=opt.weight_decay)
