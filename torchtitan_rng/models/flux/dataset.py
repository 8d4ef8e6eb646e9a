"""Synthetic image-caption pairs: one coloured shape on a dark background, and a caption that says what and where.

Sample-key protocol: ``dataset[key]`` with ``key = epoch * len(dataset) + index``. The scene depends on
``index`` only; every augmentation draw (crop, flip, caption template) comes from
the per-sample stream ``"flux-augment"`` (``rng.STREAMS``). Nothing touches the global RNGs, so a sample is the same
whichever worker makes it and whenever, and a resumed run sees exactly the samples the first run would have.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from torchtitan_rng.config import JobConfig
from torchtitan_rng.data.sample_rng import SampleRandomDataset
from torchtitan_rng.models.flux.text_encoders import tokenize
from torchtitan_rng.rng import frozen_generator, sample_purpose

DEFAULT_NUM_SAMPLES = 64
SHAPES = ("square", "circle", "triangle")
COLOURS = {
    "red": (0.95, 0.15, 0.15),
    "green": (0.15, 0.85, 0.25),
    "blue": (0.2, 0.35, 1.0),
    "yellow": (0.95, 0.9, 0.15),
    "white": (0.95, 0.95, 0.95),
    "purple": (0.7, 0.25, 0.9),
}
ROWS = ("top", "middle", "bottom")
COLUMNS = ("left", "center", "right")
TEMPLATES = (
    "a {colour} {shape} at the {position}",
    "{position}: a {colour} {shape}",
    "a picture of a {colour} {shape} in the {position}",
    "{colour} {shape}, {position}",
)
SUPERSAMPLE = 4  # rendering at 4x and averaging gives anti-aliased edges


@dataclass(frozen=True)
class Scene:
    shape: str
    colour: str
    row: int
    column: int
    background: float
    radius: float  # fraction of the image side
    jitter: tuple[float, float]  # offset from the cell centre, fraction of the image side

    @property
    def position(self) -> str:
        row, column = ROWS[self.row], COLUMNS[self.column]
        if row == "middle":
            return column
        return row if column == "center" else f"{row} {column}"


def scene_for_index(index: int) -> Scene:
    """The scene of sample ``index``: fixed data, independent of the run's seed, like a dataset on disk."""
    g = frozen_generator("flux-content", index)
    draws = torch.rand(8, generator=g).tolist()
    return Scene(
        shape=SHAPES[int(draws[0] * len(SHAPES))],
        colour=list(COLOURS)[int(draws[1] * len(COLOURS))],
        row=int(draws[2] * 3),
        column=int(draws[3] * 3),
        background=0.05 + 0.2 * draws[4],
        radius=0.09 + 0.05 * draws[5],
        jitter=(0.1 * draws[6] - 0.05, 0.1 * draws[7] - 0.05),
    )


def render(scene: Scene, size: int) -> torch.Tensor:
    """The scene as ``[3, size, size]`` float32 in [-1, 1]."""
    n = size * SUPERSAMPLE
    coords = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    y, x = torch.meshgrid(coords, coords, indexing="ij")
    dy = y - ((scene.row + 0.5) / 3 + scene.jitter[0])
    dx = x - ((scene.column + 0.5) / 3 + scene.jitter[1])
    r = scene.radius
    if scene.shape == "square":
        inside = (dx.abs() <= r) & (dy.abs() <= r)
    elif scene.shape == "circle":
        inside = dx**2 + dy**2 <= r**2
    else:  # triangle, apex up: the half-width grows from 0 at the top to r at the bottom
        inside = (dy.abs() <= r) & (dx.abs() <= (dy + r) / 2)
    coverage = F.avg_pool2d(inside[None, None].float(), SUPERSAMPLE)[0]
    colour = torch.tensor(COLOURS[scene.colour]).view(3, 1, 1)
    image = scene.background * (1 - coverage) + colour * coverage
    return image * 2 - 1


def caption(scene: Scene, template: int) -> str:
    return TEMPLATES[template].format(colour=scene.colour, shape=scene.shape, position=scene.position)


class FluxDataset(SampleRandomDataset):
    def __init__(self, config: JobConfig) -> None:
        super().__init__(config.debug.seed, sample_purpose("flux-augment"))
        self.image_size = config.training.image_size
        self.num_samples = config.data.num_samples or DEFAULT_NUM_SAMPLES
        self.pad = max(1, self.image_size // 8)

    def __len__(self) -> int:
        return self.num_samples

    def example(self, key: int) -> tuple[torch.Tensor, str]:
        """The augmented (image, caption) of sample ``key``: pad, random crop, random flip, random template."""
        scene = scene_for_index(key % self.num_samples)
        g = self.sample_generator(key)
        top, left = torch.randint(0, 2 * self.pad + 1, (2,), generator=g).tolist()
        flip = bool(torch.rand(1, generator=g) < 0.5)
        template = int(torch.randint(len(TEMPLATES), (1,), generator=g))
        padded = F.pad(render(scene, self.image_size), (self.pad,) * 4, mode="replicate")
        image = padded[:, top : top + self.image_size, left : left + self.image_size]
        if flip:
            # Flipping the scene's column (not editing the string) keeps every template's "left"/"right" right.
            image, scene = image.flip(-1), replace(scene, column=2 - scene.column)
        return image.contiguous(), caption(scene, template)

    def clean_example(self, index: int) -> tuple[torch.Tensor, str]:
        """Sample ``index`` without augmentation and with the first template (used for validation)."""
        scene = scene_for_index(index)
        return render(scene, self.image_size), caption(scene, 0)

    def __getitem__(self, key: int) -> dict[str, torch.Tensor]:
        image, text = self.example(int(key))
        return {"image": image, "caption_tokens": tokenize(text)}
