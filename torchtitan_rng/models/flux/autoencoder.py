"""A frozen stand-in for Flux's VAE: pixel-unshuffle by 2, then a fixed random orthogonal channel mix.

Being orthogonal, the mix is inverted exactly by its transpose, so ``decode(encode(x)) == x`` up to rounding
and validation pictures show what the transformer really generated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_rng.rng import frozen_generator

DOWNSCALE = 2
LATENT_CHANNELS = 3 * DOWNSCALE * DOWNSCALE


def _random_orthogonal(size: int, generator: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(size, size, generator=generator, dtype=torch.float64))
    # Fixing the signs makes Q unique for a given draw (QR alone leaves them to the LAPACK build).
    return (q * torch.sign(torch.diagonal(r))).to(torch.float32)


class Autoencoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Its own frozen generator, never the global one: the same in every run and on every rank, and building
        # it does not shift the stream the trainable weights are drawn from.
        mix = _random_orthogonal(LATENT_CHANNELS, frozen_generator("flux-autoencoder"))
        self.mix = nn.Parameter(mix, requires_grad=False)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` in [-1, 1] -> latents ``[B, 12, H/2, W/2]``."""
        return torch.einsum("oc,bchw->bohw", self.mix, F.pixel_unshuffle(images, DOWNSCALE))

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """The exact inverse of :meth:`encode` (the transpose of an orthogonal matrix is its inverse)."""
        return F.pixel_shuffle(torch.einsum("oc,bohw->bchw", self.mix, latents), DOWNSCALE)
