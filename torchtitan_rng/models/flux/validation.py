"""Validation: a fixed loss on held-out samples and a picture of what the model generates.

Everything random here comes from the stream ``"flux-validation"`` (``rng.STREAMS``), so validation consumes
nothing from the global streams the trainer checkpoints: a run with validation every N steps trains
bit-identically to one without. Every rank runs the same forwards (FSDP needs all ranks in each all-gather);
only rank 0 writes the picture.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchtitan_rng.config import JobConfig
from torchtitan_rng.models.flux.dataset import FluxDataset
from torchtitan_rng.models.flux.model import FluxModel
from torchtitan_rng.models.flux.png import write_png
from torchtitan_rng.models.flux.text_encoders import tokenize
from torchtitan_rng.rng import stream_generator

NUM_SAMPLES = 4
# Held-out scene indices: training keys reduce to indices below len(dataset), far smaller than this.
FIRST_INDEX = 1_000_000
EULER_STEPS = 8
PIXEL_SCALE = 4  # upscaling so a 16-pixel sample is visible
GAP = 2


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _sample(model: FluxModel, noise: torch.Tensor, txt: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """Euler integration of the learned velocity from ``t = 1`` (noise) to ``t = 0`` (data)."""
    x = noise
    times = torch.linspace(1.0, 0.0, EULER_STEPS + 1, device=noise.device)
    for t_now, t_next in zip(times[:-1], times[1:]):
        velocity = model(x, t_now.expand(x.shape[0]), txt, pooled)
        x = x + (t_next - t_now) * velocity
    return x


def _grid(rows: list[torch.Tensor]) -> np.ndarray:
    """Rows of ``[N, 3, H, W]`` images in [-1, 1] as one ``[H', W', 3]`` uint8 picture with white gaps."""
    tiles = [F.pad(F.interpolate(row.float().cpu(), scale_factor=PIXEL_SCALE), (GAP,) * 4, value=1.0) for row in rows]
    grid = torch.cat([torch.cat(list(row), dim=-1) for row in tiles], dim=-2)
    return ((grid.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()


def validate(
    model: FluxModel, config: JobConfig, step: int, dump_folder: Path, device: torch.device
) -> dict[str, float]:
    dataset = FluxDataset(config)
    examples = [dataset.clean_example(FIRST_INDEX + i) for i in range(NUM_SAMPLES)]
    images = torch.stack([image for image, _ in examples]).to(device)
    tokens = torch.stack([tokenize(text) for _, text in examples]).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            latents = model.autoencoder.encode(images)
            txt, pooled = model.text_encoders(tokens)
            # Drawn on the CPU from a derived generator, so they are identical on every rank and device type.
            g = stream_generator("flux-validation", config.debug.seed)
            noise = torch.randn(latents.shape, generator=g).to(device)
            t = torch.rand(NUM_SAMPLES, generator=g).to(device)
            start = torch.randn(latents.shape, generator=g).to(device)
            t_img = t[:, None, None, None]
            prediction = model((1 - t_img) * latents + t_img * noise, t, txt, pooled)
            val_loss = F.mse_loss(prediction, noise - latents).item()
            samples = model.autoencoder.decode(_sample(model, start, txt, pooled))
    finally:
        model.train(was_training)
    if _rank() == 0:
        folder = Path(dump_folder) / "validation"
        folder.mkdir(parents=True, exist_ok=True)
        grid = _grid([images, samples])  # top row: references, bottom row: generated from their captions
        write_png(folder / f"step-{step}.png", grid)
        write_png(folder / "latest.png", grid)  # the same bytes, written atomically for viewers that poll it
    return {"val_loss": val_loss}
