"""The ``llama`` train spec: next-token prediction over token files or byte-level text with the small Llama decoder."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from torchtitan_rng.config import ConfigError, JobConfig, Training
from torchtitan_rng.data.token_files import vocab_size
from torchtitan_rng.models.llama.chunked import chunks_refusal, split_llama_chunks
from torchtitan_rng.models.llama.dataset import build_text_dataset
from torchtitan_rng.models.llama.model import FLAVORS, Llama, LlamaStage, prune_to_stages
from torchtitan_rng.train_spec import Batch, PipelineSplit, TensorChunkSplit, TrainSpec, register_train_spec


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
        tensor_chunks=TensorChunkSplit(check=llama_chunks_refusal, apply=split_llama_chunks),
    )
)
