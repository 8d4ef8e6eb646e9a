"""The Flux model (frozen encoders + trainable MMDiT) and its rectified-flow training loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_rng.config import ConfigError, JobConfig, Training
from torchtitan_rng.models.flux.autoencoder import DOWNSCALE, LATENT_CHANNELS, Autoencoder
from torchtitan_rng.models.flux.mmdit import MMDiT, MMDiTArgs
from torchtitan_rng.models.flux.text_encoders import TextEncoders

PATCH_SIZE = 2
TEXT_DIM = 64
POOLED_DIM = 64

FLAVORS: dict[str, dict[str, int]] = {
    "debug": {"dim": 64, "heads": 4, "double_blocks": 2, "single_blocks": 2},
    "small": {"dim": 192, "heads": 6, "double_blocks": 4, "single_blocks": 8},
}


class FluxModel(nn.Module):
    """Frozen ``autoencoder`` and ``text_encoders`` around the trainable ``transformer`` (the only part FSDP shards)."""

    def __init__(self, transformer_args: MMDiTArgs) -> None:
        super().__init__()
        self.autoencoder = Autoencoder()
        # Both create their parameters with requires_grad=False: the optimizer sees only the transformer.
        self.text_encoders = TextEncoders(transformer_args.txt_dim, transformer_args.pooled_dim)
        self.transformer = MMDiT(transformer_args)

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, txt: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """The predicted velocity ``noise - x`` at ``x_t``."""
        return self.transformer(x_t, t, txt, pooled)


def build_flux_model(config: JobConfig) -> FluxModel:
    """Frozen parts use their own fixed generators; the transformer draws from the global RNG the trainer seeded."""
    flavor = config.model.flavor
    if flavor not in FLAVORS:
        raise ConfigError(f"model.flavor {flavor!r} is not a flux flavor; choose one of: {', '.join(FLAVORS)}")
    if config.training.image_size % (DOWNSCALE * PATCH_SIZE):
        size, multiple = config.training.image_size, DOWNSCALE * PATCH_SIZE
        raise ConfigError(f"training.image_size = {size} must be a multiple of {multiple} for model.name 'flux'")
    args = MMDiTArgs(
        in_channels=LATENT_CHANNELS, patch_size=PATCH_SIZE, txt_dim=TEXT_DIM, pooled_dim=POOLED_DIM, **FLAVORS[flavor]
    )
    return FluxModel(args)


def sample_timesteps(batch_size: int, sampling: str, device: torch.device) -> torch.Tensor:
    """``t`` in (0, 1) per sample, from the global generator of ``device``."""
    if sampling == "uniform":
        return torch.rand(batch_size, device=device)
    # Logit-normal (SD3/Flux) puts more weight on the middle of the path, where prediction is hardest.
    return torch.sigmoid(torch.randn(batch_size, device=device))


def flux_loss(model: FluxModel, batch: dict[str, torch.Tensor], training: Training) -> torch.Tensor:
    """Rectified-flow MSE. Noise, timesteps and prompt dropout come from the device's GLOBAL generator, in this
    order, so the trainer's captured RNG state fully determines them on resume."""
    images, tokens = batch["image"], batch["caption_tokens"]
    batch_size, device = images.shape[0], images.device
    with torch.no_grad():
        latents = model.autoencoder.encode(images)
        txt, pooled = model.text_encoders(tokens)
        empty_txt, empty_pooled = model.text_encoders.empty_prompt(batch_size, tokens.shape[1], device)
    noise = torch.randn(latents.shape, device=device, dtype=latents.dtype)
    t = sample_timesteps(batch_size, training.timestep_sampling, device)
    drop = torch.rand(batch_size, device=device) < training.classifier_free_guidance_prob
    txt = torch.where(drop[:, None, None], empty_txt, txt)
    pooled = torch.where(drop[:, None], empty_pooled, pooled)
    t_img = t.to(latents.dtype)[:, None, None, None]
    x_t = (1 - t_img) * latents + t_img * noise
    return F.mse_loss(model(x_t, t, txt, pooled), noise - latents)
