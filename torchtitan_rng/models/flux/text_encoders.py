"""Frozen stand-ins for Flux's text encoders: a T5-like sequence encoder and a CLIP-like pooled encoder.

Weights come from frozen-rooted generators (``rng.STREAMS``: ``flux-t5``, ``flux-clip``) and tokenisation is done in code,
so nothing is downloaded and every rank and every run has the same encoders.
"""

from __future__ import annotations

import math
import re
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_rng.rng import frozen_generator

PAD, BOS, EOS = 0, 1, 2
VOCAB_SIZE = 1024
CAPTION_LENGTH = 16


def tokenize(caption: str, length: int = CAPTION_LENGTH) -> torch.Tensor:
    """Word-level tokens ``[length]`` (int64): BOS, one id per word, EOS, then padding.

    Words are hashed (crc32, stable across processes unlike ``hash``) into the vocabulary, so any caption
    works without a vocabulary file; a caption longer than ``length - 2`` words is truncated.
    """
    words = re.findall(r"[a-z0-9]+", caption.lower())[: length - 2]
    ids = [BOS] + [3 + zlib.crc32(word.encode()) % (VOCAB_SIZE - 3) for word in words] + [EOS]
    return torch.tensor(ids + [PAD] * (length - len(ids)), dtype=torch.int64)


def _frozen_normal(generator: torch.Generator, *shape: int) -> nn.Parameter:
    # A [out, in] weight scaled by 1/sqrt(in), so activations keep unit size through the layer.
    return nn.Parameter(torch.randn(*shape, generator=generator) / math.sqrt(shape[-1]), requires_grad=False)


class T5Encoder(nn.Module):
    """Embedding + one pre-norm transformer layer (self-attention, GELU MLP): ``[B, L] -> [B, L, dim]``."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        g = frozen_generator("flux-t5")
        self.heads = heads
        self.embed = nn.Parameter(torch.randn(VOCAB_SIZE, dim, generator=g), requires_grad=False)
        self.wqkv = _frozen_normal(g, 3 * dim, dim)
        self.wo = _frozen_normal(g, dim, dim)
        self.w1 = _frozen_normal(g, 4 * dim, dim)
        self.w2 = _frozen_normal(g, dim, 4 * dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens, self.embed)
        batch, length, dim = x.shape
        q, k, v = F.linear(F.rms_norm(x, (dim,)), self.wqkv).chunk(3, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        # Padding is attended to, as Flux does with its padded T5 sequence; it keeps the encoder a pure map.
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, length, dim)
        x = x + F.linear(attn, self.wo)
        x = x + F.linear(F.gelu(F.linear(F.rms_norm(x, (dim,)), self.w1)), self.w2)
        return F.rms_norm(x, (dim,))


class ClipEncoder(nn.Module):
    """Mean of the non-padding token embeddings, normalised and projected: ``[B, L] -> [B, dim]``."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        g = frozen_generator("flux-clip")
        self.embed = nn.Parameter(torch.randn(VOCAB_SIZE, dim, generator=g), requires_grad=False)
        self.proj = _frozen_normal(g, dim, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = (tokens != PAD).unsqueeze(-1).to(self.embed.dtype)
        # BOS and EOS are never padding, so the count is at least 2 (the empty prompt too).
        mean = (F.embedding(tokens, self.embed) * mask).sum(dim=1) / mask.sum(dim=1)
        return F.linear(F.layer_norm(mean, mean.shape[-1:]), self.proj)


class TextEncoders(nn.Module):
    def __init__(self, t5_dim: int = 64, clip_dim: int = 64) -> None:
        super().__init__()
        self.t5 = T5Encoder(t5_dim)
        self.clip = ClipEncoder(clip_dim)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Caption tokens ``[B, L]`` -> (sequence ``[B, L, t5_dim]``, pooled ``[B, clip_dim]``)."""
        return self.t5(tokens), self.clip(tokens)

    def empty_prompt(self, batch_size: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoding of "" that replaces dropped captions (classifier-free guidance)."""
        tokens = tokenize("", length).to(device).expand(batch_size, length)
        return self(tokens)
