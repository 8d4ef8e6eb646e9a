"""Train specs that diverge on purpose, for the tensor locator's tests: the LLM trainer with one fault each.

Loaded with ``--job.custom_module tests.support.divergences --model.name NAME`` (the repository on PYTHONPATH:
tests/support/launch.py run_env). Each builds the same weights as ``llama``; what differs:

* ``llama_noisy_attention``: ``layers.0.attn`` returns its output plus noise from a generator seeded by the OS
  (a non-deterministic operation inside one module: two runs differ there and nowhere before it);
* ``llama_noisy_after_load``: ``llama_noisy_attention`` from its first checkpoint load on (a resumed run computes
  otherwise from the step it resumes at; a run that loads nothing is ``llama`` itself);
* ``llama_bad_load``: loading a checkpoint nudges one element of ``layers.1.ffn.up.weight`` by one ulp (a
  parameter perturbed at a resume; a run that loads nothing is ``llama`` itself);
* ``llama_bad_optimizer``: before the update of step 4, one element of the AdamW ``exp_avg`` of
  ``layers.0.attn.qkv.weight`` moves (optimizer-state corruption; the step's gradients are untouched);
* ``llama_transposed_load``: loading a checkpoint puts the square ``layers.0.attn.out.weight`` in transposed (a
  converter's bug: the same elements in other places);
* ``llama_no_dropout``: dropout switched off in the code (every ``nn.Dropout`` and the attention's ``dropout_p``
  at 0), the config unchanged.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from torchtitan_rng.config import JobConfig
from torchtitan_rng.models import get_train_spec
from torchtitan_rng.train_spec import register_train_spec

LLAMA = get_train_spec(JobConfig())
BAD_LOAD_PARAM = "layers.1.ffn.up.weight"
BAD_OPTIMIZER_PARAM = "layers.0.attn.qkv.weight"
BAD_OPTIMIZER_STEP = 4
TRANSPOSED_PARAM = "layers.0.attn.out.weight"


def make_noisy(module: nn.Module) -> None:
    """``module`` returns its output plus noise from a generator seeded by the OS: every run computes otherwise."""
    noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)

    def add_noise(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        # In the output's precision and of a size it keeps (a bfloat16 output under mixed precision rounds 1e-6 away).
        scale = max(1e-6, torch.finfo(output.dtype).eps)
        return output + (scale * torch.randn(output.shape, generator=noise)).to(output.device, output.dtype)

    module.register_forward_hook(add_noise)


def _noisy_attention(model: nn.Module) -> None:
    make_noisy(model.layers[0].attn)


def _noisy_after_load(model: nn.Module) -> None:
    model.register_load_state_dict_post_hook(lambda module, keys: make_noisy(model.layers[0].attn))


def _bad_load(model: nn.Module) -> None:
    param = model.get_parameter(BAD_LOAD_PARAM)

    def nudge(module: nn.Module, keys: Any) -> None:
        with torch.no_grad():
            first = param.view(-1)[:1]
            first.copy_(torch.nextafter(first, torch.full_like(first, float("inf"))))

    model.register_load_state_dict_post_hook(nudge)


def _transposed_load(model: nn.Module) -> None:
    param = model.get_parameter(TRANSPOSED_PARAM)

    def transpose(module: nn.Module, keys: Any) -> None:
        with torch.no_grad():
            param.copy_(param.t().clone())

    model.register_load_state_dict_post_hook(transpose)


def _no_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        elif isinstance(getattr(module, "dropout", None), float):  # the attention's dropout_p
            module.dropout = 0.0


def _bad_optimizer(model: nn.Module) -> None:
    param = model.get_parameter(BAD_OPTIMIZER_PARAM)

    def corrupt(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        state = optimizer.state.get(param, {})
        if "exp_avg" in state and int(state["step"]) == BAD_OPTIMIZER_STEP - 1:  # entering step 4's update
            state["exp_avg"].view(-1)[0] += 1e-3

    register_optimizer_step_pre_hook(corrupt)


def _with(fault: Callable[[nn.Module], None]) -> Callable[[JobConfig], nn.Module]:
    def build(config: JobConfig) -> nn.Module:
        model = LLAMA.build_model(config)
        fault(model)
        return model
    return build


for _name, _fault in (("llama_noisy_attention", _noisy_attention), ("llama_noisy_after_load", _noisy_after_load),
                      ("llama_bad_load", _bad_load),
                      ("llama_bad_optimizer", _bad_optimizer), ("llama_transposed_load", _transposed_load),
                      ("llama_no_dropout", _no_dropout)):
    register_train_spec(replace(LLAMA, name=_name, build_model=_with(_fault)))
