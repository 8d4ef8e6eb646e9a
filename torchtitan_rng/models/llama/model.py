"""A small Llama-style decoder: RMSNorm, rotary positions, SwiGLU, causal attention, with dropout."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    hidden_dim: int = 172
    dropout: float = 0.1
    rope_theta: float = 10000.0
    max_seq_len: int = 512


FLAVORS: dict[str, LlamaArgs] = {
    "debug": LlamaArgs(),
    "small": LlamaArgs(dim=256, n_layers=4, n_heads=8, hidden_dim=688),
    # debug's width with four blocks: enough to split into four pipeline stages (two per rank, interleaved).
    "debug4": LlamaArgs(n_layers=4),
    # 85M parameters with a byte-level vocabulary (341 MB in float32): the benchmarks that need a large model.
    "bench": LlamaArgs(dim=768, n_layers=12, n_heads=12, hidden_dim=2048, dropout=0.0),
}


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]; rotate (even, odd) pairs by position-dependent angles.
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2)


class Attention(nn.Module):
    """The projection's rows are head-major (each head's q, k and v side by side), so that a column split of
    ``qkv`` gives each tensor-parallel rank whole heads; the head count is read from the projection's output
    (all heads, or a rank's)."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.qkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
        self.out = nn.Linear(args.dim, args.dim, bias=False)
        self.dropout = args.dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).unflatten(-1, (-1, 3, self.head_dim)).permute(3, 0, 2, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.out(attn.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.gate = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.up = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.down = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(args.dim)
        self.attn = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim)
        self.ffn = FeedForward(args)
        self.dropout = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), cos, sin))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class Llama(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.embed_dropout = nn.Dropout(args.dropout)
        cos, sin = rotary_tables(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.embed_dropout(self.embed(tokens))
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


class LlamaStage(nn.Module):
    """A pipeline stage of a :class:`Llama`: some of its blocks, with the embedding before them (first stage)
    or the norm and output after them (last stage); the modules are the model's own, so their parameters keep
    the model's names in a checkpoint. The same computation as :meth:`Llama.forward` over the same blocks."""

    def __init__(self, model: Llama, layers: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.embed = model.embed if first else None
        self.embed_dropout = model.embed_dropout
        self.layers = nn.ModuleList(model.layers[index] for index in layers)
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed_dropout(self.embed(x))
        seq = x.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x)) if self.output is not None else x


def prune_to_stages(model: Llama, layers: set[int], first: bool, last: bool) -> None:
    """Keep only what this rank's stages hold: other blocks become parameterless placeholders (the kept ones
    keep their index, hence their names), and the embedding, norm and output go where no stage here has them."""
    for index in range(len(model.layers)):
        if index not in layers:
            model.layers[index] = nn.Identity()
    if not first:
        model.embed = None
    if not last:
        model.norm = None
        model.output = None
