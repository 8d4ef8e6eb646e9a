"""A form-2 train spec for the tests: the LLM trainer with token masking drawn from the global RNGs.

Loaded with ``--job.custom_module tests.support.global_rng_spec --model.name llama_global_mask`` (the
repository on PYTHONPATH: tests/support/launch.py run_env).
``__getitem__`` uses torch's, NumPy's and Python's global streams, like most augmentation code in the wild,
so only the worker-RNG capture (data.capture_worker_rng) can make a resume with workers exact.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import torch
from torch.utils.data import Dataset

from torchtitan_rng.config import JobConfig
from torchtitan_rng.models.llama.spec import build_text_dataset
from torchtitan_rng.models import get_train_spec
from torchtitan_rng.train_spec import register_train_spec


class GlobalMaskDataset(Dataset):
    def __init__(self, inner: Dataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, key: int) -> dict[str, torch.Tensor]:
        sample = dict(self.inner[key])
        tokens = sample["input"].clone()
        if random.random() < 0.9:
            mask = torch.rand(tokens.shape) < 0.15
            tokens[mask] = int(np.random.randint(0, 256))
        sample["input"] = tokens
        return sample


def build_masked_dataset(config: JobConfig) -> Dataset:
    return GlobalMaskDataset(build_text_dataset(config))


register_train_spec(
    replace(get_train_spec(JobConfig()), name="llama_global_mask", build_dataset=build_masked_dataset)
)
