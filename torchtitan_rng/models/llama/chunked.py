"""Llama's blocks split into tensor chunks, for the world-size-invariant mode (``parallel/invariant/chunks.py``):
attention by heads (``qkv`` column-split, ``out`` row-split) and SwiGLU by hidden features (``gate`` and ``up``
column-split, ``down`` row-split), in ``parallelism.tensor_parallel_chunks`` chunks at every tensor-parallel degree.
The embedding, the norms and the output layer stay whole on every rank. ``qkv``'s rows are head-major (each
head's query, key and value side by side), so a chunk of heads is one block of rows.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from torchtitan_rng.models.llama.model import Attention, FeedForward, LlamaArgs, apply_rotary
from torchtitan_rng.parallel.invariant.chunks import ChunkPlacement, column_chunks, fan_out, row_chunks
from torchtitan_rng.parallel.invariant.streams import ChunkStreams


def chunks_refusal(args: LlamaArgs, chunks: int) -> str | None:
    """Why ``args``' blocks cannot split into ``chunks`` chunks, in one line; None: they can."""
    for name, size in (("attention heads (n_heads)", args.n_heads), ("SwiGLU hidden features (hidden_dim)",
                                                                     args.hidden_dim)):
        if size % chunks:
            divisors = ", ".join(str(n) for n in range(1, size + 1) if size % n == 0 and n <= 64)
            return (f"parallelism.tensor_parallel_chunks = {chunks} does not divide the model's {size} {name}; "
                    f"choose one of {divisors}")
    return None


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's chunks of a split weight (the whole weight on one process)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _split(linear: nn.Linear, dim: int, placement: ChunkPlacement, mesh: object | None) -> None:
    """Keep this rank's chunks of ``linear``'s weight, as a DTensor sharded along ``dim`` over ``mesh`` (so that a
    checkpoint holds the whole weight at every degree); one process keeps it whole."""
    if mesh is None:
        return
    local = linear.weight.detach().chunk(placement.degree, dim=dim)[placement.rank].clone()
    linear.weight = nn.Parameter(DTensor.from_local(local, mesh, [Shard(dim)], run_check=False))


class ChunkedAttention(nn.Module):
    """:class:`Attention` over this rank's chunks of heads, each chunk's attention by itself, with its dropout
    drawn from the chunk's stream."""

    def __init__(self, attention: Attention, placement: ChunkPlacement, streams: ChunkStreams,
                 mesh: object | None) -> None:
        super().__init__()
        self.qkv, self.out = attention.qkv, attention.out  # the same modules: the same parameter names
        self.head_dim, self.dropout = attention.head_dim, attention.dropout
        self.placement, self.streams = placement, streams
        _split(self.qkv, 0, placement, mesh)
        _split(self.out, 1, placement, mesh)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        placement = self.placement
        dropout = self.dropout if self.training else 0.0
        stream = self.streams.per_chunk() if dropout > 0 else lambda c: contextlib.nullcontext()
        outputs = []
        for c, qkv in zip(placement.local, column_chunks(fan_out(x, placement), _local(self.qkv.weight), placement)):
            q, k, v = qkv.unflatten(-1, (-1, 3, self.head_dim)).permute(3, 0, 2, 1, 4)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            with stream(c):
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
            outputs.append(attn.transpose(1, 2).reshape(batch, seq, -1))
        return row_chunks(outputs, _local(self.out.weight), placement)


class ChunkedFeedForward(nn.Module):
    """:class:`FeedForward` over this rank's chunks of hidden features."""

    def __init__(self, ffn: FeedForward, placement: ChunkPlacement, mesh: object | None) -> None:
        super().__init__()
        self.gate, self.up, self.down = ffn.gate, ffn.up, ffn.down
        self.placement = placement
        _split(self.gate, 0, placement, mesh)
        _split(self.up, 0, placement, mesh)
        _split(self.down, 1, placement, mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        placement = self.placement
        inputs = fan_out(x, placement)  # one alias per chunk for gate and up: their two gradients add either way
        gates = column_chunks(inputs, _local(self.gate.weight), placement)
        ups = column_chunks(inputs, _local(self.up.weight), placement)
        return row_chunks([F.silu(g) * u for g, u in zip(gates, ups)], _local(self.down.weight), placement)


def split_llama_chunks(model: nn.Module, placement: ChunkPlacement, streams: ChunkStreams,
                       mesh: object | None) -> list[tuple[nn.Module, int]]:
    """Split every block ``model`` holds (a pipeline stage's placeholders skipped) into this rank's chunks, in
    place; ``mesh``: the tensor-parallel ranks (None on one of them). Returns the split layers and the dimension
    of their weight that is split."""
    split: list[tuple[nn.Module, int]] = []
    for block in model.layers:
        if isinstance(getattr(block, "attn", None), Attention):
            block.attn = ChunkedAttention(block.attn, placement, streams, mesh)
            block.ffn = ChunkedFeedForward(block.ffn, placement, mesh)
            split += [(block.attn.qkv, 0), (block.attn.out, 1), (block.ffn.gate, 0), (block.ffn.up, 0),
                      (block.ffn.down, 1)]
    return split
