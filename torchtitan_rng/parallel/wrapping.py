"""What wraps a built model for training, in torchtitan's order: activation checkpointing, then torch.compile,
then FSDP2 with its mixed-precision policy (several processes) — and the autocast a single process uses instead.

Random streams: torch.utils.checkpoint stashes the CPU and device generator states before a checkpointed
forward and puts them back for its recomputation, so dropout recomputed in the backward draws the same masks
and the stream ends where the forward left it. Inductor's random kernels take their seeds from the global
generator at each call of a compiled graph, and dynamo saves and restores the global streams around its
tracing, so compiling (also the first step after a resume, which compiles again) moves no stream.

What a resumed process compiles must also be what the uninterrupted one ran: see :func:`_compile_static`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan_rng.config import ActivationCheckpoint, Compile, ConfigError, Training
from torchtitan_rng.train_spec import LossFn, TrainSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Selective "op" checkpointing keeps the outputs of these (the expensive ops) and recomputes everything else.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
}


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_selective_contexts() -> tuple[ContextManager, ContextManager]:
    return create_selective_checkpoint_contexts(_save_matmuls)


def _block_lists(spec: TrainSpec, model: nn.Module, feature: str) -> list[nn.ModuleList]:
    if spec.block_lists is None:
        raise ConfigError(f"{feature} needs the train spec {spec.name!r} to name its blocks (TrainSpec.block_lists)")
    return spec.block_lists(model)


def apply_activation_checkpointing(model: nn.Module, spec: TrainSpec, ac: ActivationCheckpoint) -> None:
    """Wrap blocks in non-reentrant checkpointing: every block (full), every Nth, or per op (selective)."""
    if ac.mode == "none":
        return
    every_nth = int(ac.selective_ac_option) if ac.mode == "selective" and ac.selective_ac_option != "op" else 1
    options: dict[str, Any] = {"preserve_rng_state": True}
    if ac.mode == "selective" and ac.selective_ac_option == "op":
        options["context_fn"] = _op_selective_contexts
    count = 0
    for blocks in _block_lists(spec, model, "activation_checkpoint.mode"):
        for index, block in enumerate(blocks):
            count += 1  # counted across all block lists, as one stack of layers
            if count % every_nth == 0:
                blocks[index] = checkpoint_wrapper(block, **options)


def _compile_static() -> None:
    """Compiled code that depends on the shapes of this call only. By default dynamo may recompile a graph
    with dynamic shapes (automatic dynamic shapes, and a profile of earlier runs where one is kept), and a
    resumed process need not make the same choice as the run it continues: other kernels, other summation
    order. Seen here: two identical llama_small runs whose logged losses differed by one ulp on 28 of 100
    steps; with static shapes, equal."""
    torch._dynamo.config.automatic_dynamic_shapes = False
    torch._dynamo.config.automatic_dynamic_local_pgo = False


def apply_compile(model: nn.Module, spec: TrainSpec, compile_config: Compile) -> None:
    """Compile each block in place of itself (the state-dict names lose ``_orig_mod`` on save)."""
    if not (compile_config.enable and "model" in compile_config.components):
        return
    _compile_static()
    for blocks in _block_lists(spec, model, "compile.components = model"):
        for index, block in enumerate(blocks):
            blocks[index] = torch.compile(block)


def compiled_loss(loss_fn: LossFn, model: nn.Module, compile_config: Compile) -> LossFn:
    """The loss around the model call, compiled when ``compile.components`` has ``loss``.

    The model's own forward is left out of that graph (its blocks are compiled on their own, and FSDP's
    hooks run eagerly around them): dynamo breaks the graph at the call.
    """
    if not (compile_config.enable and "loss" in compile_config.components):
        return loss_fn
    _compile_static()
    model.forward = torch.compiler.disable(model.forward)
    return torch.compile(loss_fn)


def fsdp_mixed_precision(training: Training) -> MixedPrecisionPolicy:
    """FSDP2's policy: parameters gathered in ``mixed_precision_param``, gradients reduced in ``_reduce``."""
    return MixedPrecisionPolicy(param_dtype=_DTYPES[training.mixed_precision_param],
                                reduce_dtype=_DTYPES[training.mixed_precision_reduce])


def autocast_context(training: Training, device: torch.device, sharded: bool) -> Callable[[], ContextManager]:
    """Without FSDP (one process, or the world-size-invariant mode's replicated parameters) nothing casts the
    parameters: bf16 compute there is autocast around forward and loss."""
    dtype = _DTYPES[training.mixed_precision_param]
    if sharded or dtype == torch.float32:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)
