"""A small MMDiT in the shape of Flux: double-stream blocks, then single-stream blocks.

Double-stream blocks keep separate weights for image and text tokens but attend jointly over both; single-
stream blocks process the concatenated sequence with one set of weights. Every block is modulated (adaLN) by
a vector made of the timestep embedding and the pooled text embedding. Image tokens carry 2-D axial rotary
positions; text tokens sit at position (0, 0), i.e. no rotation, as in Flux.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MMDiTArgs:
    in_channels: int
    patch_size: int
    dim: int
    heads: int
    double_blocks: int
    single_blocks: int
    txt_dim: int
    pooled_dim: int
    mlp_ratio: float = 4.0
    rope_theta: float = 10_000.0


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10_000.0) -> torch.Tensor:
    """Sinusoidal features of ``t`` in [0, 1] (scaled by 1000 so the low frequencies still vary)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    angles = 1000.0 * t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def axial_rope_angles(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """Rotation angles ``[S, head_dim/2]``: the first half of the pairs follows the row, the second the column."""
    axis_dim = head_dim // 2
    freqs = theta ** (-torch.arange(0, axis_dim, 2, device=positions.device, dtype=torch.float32) / axis_dim)
    return torch.cat([positions[:, 0:1] * freqs, positions[:, 1:2] * freqs], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of ``x [B, H, S, head_dim]`` by the angles whose cos/sin are ``[S, head_dim/2]``."""
    pairs = x.unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


class MLP(nn.Sequential):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))


class _Stream(nn.Module):
    """One modality's weights inside a double-stream block."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.modulation = nn.Linear(dim, 6 * dim)
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = nn.RMSNorm(dim // heads)
        self.k_norm = nn.RMSNorm(dim // heads)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = MLP(dim, int(dim * mlp_ratio))


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
    return out.transpose(1, 2).flatten(-2)


class DoubleStreamBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.heads = heads
        self.img = _Stream(dim, heads, mlp_ratio)
        self.txt = _Stream(dim, heads, mlp_ratio)

    def _qkv(self, s: _Stream, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> list[torch.Tensor]:
        q, k, v = (_heads(t, self.heads) for t in s.qkv(modulate(s.norm1(x), shift, scale)).chunk(3, dim=-1))
        return [s.q_norm(q), s.k_norm(k), v]

    def forward(
        self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        img_mod = self.img.modulation(F.silu(vec)).unsqueeze(1).chunk(6, dim=-1)
        txt_mod = self.txt.modulation(F.silu(vec)).unsqueeze(1).chunk(6, dim=-1)
        img_qkv = self._qkv(self.img, img, img_mod[0], img_mod[1])
        txt_qkv = self._qkv(self.txt, txt, txt_mod[0], txt_mod[1])
        # Joint attention: text first, then image, matching the order of the rotary angles.
        q, k, v = (torch.cat([t, i], dim=2) for t, i in zip(txt_qkv, img_qkv))
        txt_attn, img_attn = _attention(q, k, v, cos, sin).split([txt.shape[1], img.shape[1]], dim=1)
        img = img + img_mod[2] * self.img.proj(img_attn)
        img = img + img_mod[5] * self.img.mlp(modulate(self.img.norm2(img), img_mod[3], img_mod[4]))
        txt = txt + txt_mod[2] * self.txt.proj(txt_attn)
        txt = txt + txt_mod[5] * self.txt.mlp(modulate(self.txt.norm2(txt), txt_mod[3], txt_mod[4]))
        return img, txt


class SingleStreamBlock(nn.Module):
    """Attention and MLP in parallel from one input projection, as in Flux's single blocks."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.heads = heads
        self.mlp_hidden = int(dim * mlp_ratio)
        self.modulation = nn.Linear(dim, 3 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear1 = nn.Linear(dim, 3 * dim + self.mlp_hidden)
        self.q_norm = nn.RMSNorm(dim // heads)
        self.k_norm = nn.RMSNorm(dim // heads)
        self.linear2 = nn.Linear(dim + self.mlp_hidden, dim)

    def forward(self, x: torch.Tensor, vec: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.modulation(F.silu(vec)).unsqueeze(1).chunk(3, dim=-1)
        qkv, mlp = self.linear1(modulate(self.norm(x), shift, scale)).split([3 * x.shape[-1], self.mlp_hidden], -1)
        q, k, v = (_heads(t, self.heads) for t in qkv.chunk(3, dim=-1))
        attn = _attention(self.q_norm(q), self.k_norm(k), v, cos, sin)
        return x + gate * self.linear2(torch.cat([attn, F.gelu(mlp, approximate="tanh")], dim=-1))


class FinalLayer(nn.Module):
    def __init__(self, dim: int, out_dim: int) -> None:
        super().__init__()
        self.modulation = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, out_dim)
        # A zero output layer starts the model at "predict zero velocity", a stable start for flow matching.
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale = self.modulation(F.silu(vec)).unsqueeze(1).chunk(2, dim=-1)
        return self.linear(modulate(self.norm(x), shift, scale))


def patchify(latents: torch.Tensor, p: int) -> torch.Tensor:
    """``[B, C, H, W] -> [B, (H/p)(W/p), C*p*p]``, patches in row-major order."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), -1)


def unpatchify(tokens: torch.Tensor, p: int, channels: int, h: int, w: int) -> torch.Tensor:
    """The inverse of :func:`patchify` for latents of height ``h`` and width ``w``."""
    b = tokens.shape[0]
    return tokens.reshape(b, h // p, w // p, channels, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, channels, h, w)


class MMDiT(nn.Module):
    """Velocity predictor: (noisy latents, t, text sequence, pooled text) -> velocity, shaped like the latents."""

    def __init__(self, args: MMDiTArgs) -> None:
        super().__init__()
        if args.dim % args.heads or (args.dim // args.heads) % 4:
            raise ValueError(f"dim {args.dim} / heads {args.heads} must be a multiple of 4 for 2-D rotary pairs")
        self.args = args
        patch_dim = args.in_channels * args.patch_size**2
        self.img_in = nn.Linear(patch_dim, args.dim)
        self.txt_in = nn.Linear(args.txt_dim, args.dim)
        self.time_in = MLP(args.dim, args.dim)
        self.vector_in = nn.Sequential(nn.Linear(args.pooled_dim, args.dim), nn.SiLU(), nn.Linear(args.dim, args.dim))
        blocks = (args.dim, args.heads, args.mlp_ratio)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(*blocks) for _ in range(args.double_blocks))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(*blocks) for _ in range(args.single_blocks))
        self.final = FinalLayer(args.dim, patch_dim)

    def _rope(self, txt_len: int, h: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        img_pos = torch.stack([rows.flatten(), cols.flatten()], dim=-1).float()
        positions = torch.cat([torch.zeros(txt_len, 2, device=device), img_pos])
        angles = axial_rope_angles(positions, self.args.dim // self.args.heads, self.args.rope_theta)
        return torch.cos(angles), torch.sin(angles)

    def forward(self, latents: torch.Tensor, t: torch.Tensor, txt: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        p = self.args.patch_size
        _, channels, h, w = latents.shape
        img = self.img_in(patchify(latents, p))
        txt = self.txt_in(txt)
        vec = self.time_in(timestep_embedding(t, self.args.dim).to(img.dtype)) + self.vector_in(pooled)
        cos, sin = self._rope(txt.shape[1], h // p, w // p, latents.device)
        for block in self.double_blocks:
            img, txt = block(img, txt, vec, cos, sin)
        x = torch.cat([txt, img], dim=1)
        for block in self.single_blocks:
            x = block(x, vec, cos, sin)
        return unpatchify(self.final(x[:, txt.shape[1]:], vec), p, channels, h, w)
