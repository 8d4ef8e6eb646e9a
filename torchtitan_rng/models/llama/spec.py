"""The ``llama`` train spec: next-token prediction over token files or byte-level text with the small Llama decoder."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from torchtitan_rng.config import ConfigError, JobConfig, Training
from torchtitan_rng.data.token_files import vocab_size
from torchtitan_rng.models.llama.chunked import chunks_refusal, split_llama_chunks
from torchtitan_rng.models.llama.dataset import build_text_dataset
from torchtitan_rng.models.llama.model import FLAVORS, Block, Llama, LlamaStage, prune_to_stages
from torchtitan_rng.parallel.tensor import ReplicatedParallel
from torchtitan_rng.train_spec import (Batch, PipelineSplit, TensorChunkSplit, TensorParallelSplit, TrainSpec,
                                       register_train_spec)


def build_llama(config: JobConfig) -> Llama:
    if config.model.flavor not in FLAVORS:
        raise ConfigError(f"unknown llama flavor {config.model.flavor!r}; choose one of: {', '.join(FLAVORS)}")
    args = FLAVORS[config.model.flavor]
    if config.training.seq_len > args.max_seq_len:
        raise ConfigError(f"config training.seq_len = {config.training.seq_len} exceeds {args.max_seq_len}")
    # The vocabulary follows the data (model.vocab_size 0: derived from it; set: checked against it).
    return Llama(replace(args, vocab_size=vocab_size(config.training.dataset_path, config.model.vocab_size)))


def deeper_flavor(layers: int) -> str:
    """The smallest flavor with at least ``layers`` blocks, as an override ("": none has that many)."""
    deep = sorted((args.n_layers, args.dim, name) for name, args in FLAVORS.items() if args.n_layers >= layers)
    return f"--model.flavor {deep[0][2]}" if deep else ""


def llama_chunks_refusal(config: JobConfig, chunks: int) -> str | None:
    """Why the configured flavor's blocks cannot split into ``chunks`` chunks (None: they can, or the flavor is
    unknown, which the build refuses)."""
    args = FLAVORS.get(config.model.flavor)
    return chunks_refusal(args, chunks) if args is not None else None


def llama_loss(model: nn.Module, batch: Batch, training: Training) -> torch.Tensor:
    return next_token_loss(model(batch["input"]), batch["labels"])


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def check_tensor_parallel(config: JobConfig, degree: int) -> str | None:
    """The attention heads and the MLP's hidden units split evenly over ``degree`` ranks, or the line saying not."""
    args = FLAVORS.get(config.model.flavor)
    if args is None:  # an unknown flavor is refused by build_llama with the list of flavors
        return None
    for count, what in ((args.n_heads, "attention heads (and key/value heads)"), (args.hidden_dim, "MLP hidden units")):
        if count % degree:
            divisors = ", ".join(str(d) for d in range(1, args.n_heads + 1)
                                 if args.n_heads % d == 0 and args.hidden_dim % d == 0)
            return (f"llama flavor {config.model.flavor!r} has {count} {what}, which {degree} ranks do not split "
                    f"evenly; choose a degree dividing both its {args.n_heads} heads and {args.hidden_dim} hidden "
                    f"units ({divisors})")
    return None


def split_llama(model: nn.Module, mesh: DeviceMesh) -> None:
    """torchtitan's plan for its Llama, on this model: attention and the SwiGLU MLP split column-wise then
    row-wise (whole heads per rank), the embedding by vocabulary rows, the output projection by vocabulary columns
    gathered whole for the loss, the norms replicated. Between blocks the activations stay whole on every rank
    (no sequence split): their dropout then draws one mask, the same on every rank of the group, on any device
    (a CPU mesh cannot split a random draw). Parts a pipeline stage does not hold are skipped."""
    if model.embed is not None:
        parallelize_module(model.embed, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    for block in model.layers:
        if isinstance(block, Block):
            parallelize_module(block, mesh, {
                "attn_norm": ReplicatedParallel(), "attn.qkv": ColwiseParallel(), "attn.out": RowwiseParallel(),
                "ffn_norm": ReplicatedParallel(), "ffn.gate": ColwiseParallel(), "ffn.up": ColwiseParallel(),
                "ffn.down": RowwiseParallel(),
            })
    if model.output is not None:
        parallelize_module(model.norm, mesh, ReplicatedParallel())
        parallelize_module(model.output, mesh, ColwiseParallel(output_layouts=Replicate()))


def shard_llama(model: nn.Module, mesh: object, mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy()) -> None:
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


register_train_spec(
    TrainSpec(
        name="llama",
        build_model=build_llama,
        build_dataset=build_text_dataset,
        loss_fn=llama_loss,
        apply_fsdp=shard_llama,
        items_per_sample=lambda config: config.training.seq_len,
        throughput_unit="tokens",
        block_lists=lambda model: [model.layers],
        pipeline=PipelineSplit(prune=prune_to_stages, stage=LlamaStage, loss=next_token_loss, input_key="input",
                               target_key="labels", deeper=deeper_flavor),
        tensor_parallel=TensorParallelSplit(check=check_tensor_parallel, apply=split_llama),
        tensor_chunks=TensorChunkSplit(check=llama_chunks_refusal, apply=split_llama_chunks),
    )
)
