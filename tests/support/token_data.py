"""Token data written by the tests themselves: a .bin of random uint16 ids and a small .jsonl (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from torchtitan_rng.models.llama.dataset import default_corpus


def write_token_file(path: Path, count: int = 40_000, vocab: int = 1000, seed: int = 0) -> Path:
    """nanoGPT's train.bin layout: flat little-endian uint16; the id ``vocab - 1`` occurs once, none above."""
    tokens = np.random.default_rng(seed).integers(0, vocab - 1, count).astype("<u2")
    tokens[count // 3] = vocab - 1
    tokens.tofile(path)
    return path


def write_jsonl(path: Path, records: int = 300) -> Path:
    """One record per 12 lines of Python's own source text, with a blank line and non-ASCII text among them."""
    lines = default_corpus().decode().splitlines()
    with open(path, "w") as file:
        for i in range(records):
            text = "\n".join(lines[12 * i : 12 * i + 12]) + (" naïve café" if i % 5 == 0 else "")
            file.write(json.dumps({"id": i, "text": text}) + "\n")
            if i == 7:
                file.write("\n")
    return path


def write_bad_jsonl(folder: Path, line: str) -> Path:
    """``folder``/bad.jsonl: a good record, a blank line, then ``line`` (line 3)."""
    path = folder / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n' + line + "\n")
    return path
