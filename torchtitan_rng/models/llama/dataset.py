"""The LLM trainer's data: token windows with random offsets (derived per sample), or a streaming source.

``training.dataset_path`` names a token file, JSON Lines or a text file (see ``data/token_files.py``).
With none, the text is the source of a few modules of Python's own standard library, so nothing is
downloaded; it can differ between Python versions, never between two runs on one machine.
"""

from __future__ import annotations

import importlib
import inspect
from functools import partial

import numpy as np
import torch

from torchtitan_rng.config import ConfigError, JobConfig
from torchtitan_rng.data import token_files
from torchtitan_rng.data.sample_rng import SampleRandomDataset
from torchtitan_rng.data.streaming import TokenReader, WindowStream
from torchtitan_rng.rng import sample_purpose

_STDLIB_MODULES = ("textwrap", "heapq", "bisect", "fractions", "random", "string", "difflib")


def default_corpus() -> bytes:
    return "\n".join(inspect.getsource(importlib.import_module(name)) for name in _STDLIB_MODULES).encode()


def load_tokens(dataset_path: str) -> token_files.TokenArray | np.ndarray:
    """Every token of the data, with random access."""
    if not dataset_path:
        return np.frombuffer(default_corpus(), dtype=np.uint8)
    return token_files.load_tokens(dataset_path)


class TokenWindowDataset(SampleRandomDataset):
    """Sample ``index`` is a window of ``seq_len + 1`` tokens starting near ``index * stride``.

    The exact start is shifted by a random offset drawn from the sample's own generator (purpose
    ``"llm-window"``; form 1 of data randomness: a pure function of the sample key).
    """

    def __init__(self, tokens: token_files.TokenArray | np.ndarray, seq_len: int, seed: int,
                 num_samples: int = 0, source: str = "the text") -> None:
        super().__init__(seed, sample_purpose("llm-window"))
        self.tokens = tokens
        self.seq_len = seq_len
        self.stride = seq_len + 1
        available = (len(tokens) - 2 * self.stride) // self.stride
        if available < 1:
            raise ConfigError(f"config training.dataset_path: {source} has {len(tokens)} tokens, too few for "
                              f"seq_len {seq_len}")
        self.num_samples = min(num_samples, available) if num_samples > 0 else available

    def __len__(self) -> int:
        return self.num_samples

    def token_offset(self, key: int) -> int:
        """Where sample ``key``'s window starts in the data's tokens (``samples`` and ``replay`` print it)."""
        _, index = self.epoch_and_index(key)
        return index * self.stride + int(torch.randint(0, self.stride, (1,), generator=self.sample_generator(key)))

    def __getitem__(self, key: int) -> dict[str, torch.Tensor]:
        start = self.token_offset(key)
        window = torch.from_numpy(np.asarray(self.tokens[start : start + self.stride]).astype(np.int64))
        return {"input": window[:-1], "labels": window[1:]}


def build_window_stream(config: JobConfig) -> WindowStream:
    """``data.streaming``: the data read front to back through a saved shuffle buffer."""
    path = config.training.dataset_path
    open_reader: partial[TokenReader]
    if token_files.is_jsonl(path):
        open_reader = partial(token_files.JsonlReader, path)
        token_files.JsonlReader(path)  # a missing file is reported now, not by a worker
    else:
        open_reader = partial(token_files.ArrayReader, load_tokens(path))
    return WindowStream(open_reader, seq_len=config.training.seq_len, seed=config.debug.seed,
                        buffer_size=config.data.shuffle_buffer, windows_per_epoch=config.data.num_samples,
                        source=path or "the default text")


def build_text_dataset(config: JobConfig) -> TokenWindowDataset | WindowStream:
    if config.data.streaming:
        return build_window_stream(config)
    path = config.training.dataset_path
    return TokenWindowDataset(load_tokens(path), config.training.seq_len, config.debug.seed,
                              config.data.num_samples, source=path or "the default text")
