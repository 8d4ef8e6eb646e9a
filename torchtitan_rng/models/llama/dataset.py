"""The LLM trainer's data: byte-level tokens over a text, with random window offsets (derived per sample).

With no ``training.dataset_path`` the text is the source of a few modules of Python's own standard
library, so nothing is downloaded; it can differ between Python versions, never between two runs on one
machine.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from torchtitan_rng.data.sample_rng import SampleRandomDataset

_STDLIB_MODULES = ("textwrap", "heapq", "bisect", "fractions", "random", "string", "difflib")


def default_corpus() -> bytes:
    import importlib

    return "\n".join(inspect.getsource(importlib.import_module(name)) for name in _STDLIB_MODULES).encode()


def load_corpus(dataset_path: str) -> bytes:
    if not dataset_path:
        return default_corpus()
    return Path(dataset_path).read_bytes()


class ByteWindowDataset(SampleRandomDataset):
    """Sample ``index`` is a window of ``seq_len + 1`` bytes starting near ``index * stride``.

    The exact start is shifted by a random offset drawn from the sample's own generator (purpose
    ``"llm-window"``; form 1 of data randomness: a pure function of the sample key).
    """

    vocab_size = 256  # byte-level: every byte value is a token

    def __init__(self, corpus: bytes, seq_len: int, seed: int, num_samples: int = 0) -> None:
        super().__init__(seed, "llm-window")
        self.tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
        self.seq_len = seq_len
        self.stride = seq_len + 1
        available = (len(self.tokens) - 2 * self.stride) // self.stride
        if available < 1:
            raise ValueError(f"the text has {len(self.tokens)} bytes, too few for seq_len {seq_len}")
        self.num_samples = min(num_samples, available) if num_samples > 0 else available

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, key: int) -> dict[str, torch.Tensor]:
        _, index = self.epoch_and_index(key)
        offset = int(torch.randint(0, self.stride, (1,), generator=self.sample_generator(key)))
        start = index * self.stride + offset
        window = self.tokens[start : start + self.stride]
        return {"input": window[:-1], "labels": window[1:]}
