"""Token data files for the LLM trainer: the formats, their vocabulary, random access and sequential reading.

``training.dataset_path`` picks the format by its suffix:

* ``.bin``: pre-tokenized, flat little-endian ``uint16`` token ids (nanoGPT's ``train.bin``), memory-mapped;
  its vocabulary is the largest id + 1.
* ``.jsonl``: JSON Lines, a ``text`` string per line (blank lines skipped); byte-level tokens: each text's
  UTF-8 bytes followed by a newline. Vocabulary 256.
* anything else: a UTF-8 text file, its bytes are the tokens. Vocabulary 256.

Every problem with a file is a :class:`ConfigError` naming the file (and the line, for ``.jsonl``).
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any, BinaryIO

import numpy as np

from torchtitan_rng.config import ConfigError

BYTE_VOCAB = 256
_TOKEN_DTYPE = np.dtype("<u2")  # nanoGPT's train.bin layout


def is_token_file(path: str) -> bool:
    return path.endswith(".bin")


def is_jsonl(path: str) -> bool:
    return path.endswith(".jsonl")


def _error(path: str, problem: str) -> ConfigError:
    return ConfigError(f"config training.dataset_path: {path} {problem}")


def _file_size(path: str) -> int:
    try:
        info = os.stat(path)
    except OSError as err:
        raise ConfigError(f"config training.dataset_path: cannot read {path!r} ({err.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise _error(path, "is not a file")
    return info.st_size


def _token_count(path: str) -> int:
    """Tokens in a ``.bin`` or text file, checking that a ``.bin`` holds whole uint16 tokens."""
    size = _file_size(path)
    if is_token_file(path) and size % _TOKEN_DTYPE.itemsize:
        raise _error(path, f"has {size} bytes, not a whole number of 2-byte tokens (a .bin file is flat "
                           "little-endian uint16 token ids, nanoGPT's train.bin layout)")
    return size // (_TOKEN_DTYPE.itemsize if is_token_file(path) else 1)


def jsonl_line_tokens(path: str, line_no: int, line: bytes) -> np.ndarray | None:
    """The byte tokens of one ``.jsonl`` line (its text and a newline); None for a blank line."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        reason = err.msg if isinstance(err, json.JSONDecodeError) else "not UTF-8"
        raise _error(path, f"line {line_no}: not valid JSON ({reason}); each line must be an object with a "
                           "\"text\" string") from None
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise _error(path, f"line {line_no}: no \"text\" field holding a string")
    return np.frombuffer(text.encode() + b"\n", dtype=np.uint8)


class TokenArray:
    """The whole token sequence of a ``.bin`` or text file, memory-mapped on first use.

    It pickles as its path, so dataloader workers map the file themselves instead of receiving a copy.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.length = _token_count(path)
        self._tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, window: slice) -> np.ndarray:
        if self._tokens is None:
            dtype = _TOKEN_DTYPE if is_token_file(self.path) else np.uint8
            self._tokens = np.memmap(self.path, dtype=dtype, mode="r", shape=(self.length,))
        return self._tokens[window]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}


def load_tokens(path: str) -> TokenArray | np.ndarray:
    """Random access to every token of the file (a ``.jsonl`` is parsed into memory)."""
    if not is_jsonl(path):
        return TokenArray(path)
    _file_size(path)
    parts: list[np.ndarray] = []
    with open(path, "rb") as file:
        for line_no, line in enumerate(file, start=1):
            tokens = jsonl_line_tokens(path, line_no, line)
            if tokens is not None:
                parts.append(tokens)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)


def vocab_size(path: str, configured: int) -> int:
    """The model's vocabulary for this data: ``configured`` when > 0 (checked against the data), else derived.

    A ``.bin`` is scanned once with NumPy (a max over the memory map); byte-level data has 256 ids.
    """
    if path and is_token_file(path):
        tokens = TokenArray(path)
        if len(tokens) == 0:
            raise _error(path, "holds no tokens")
        largest = int(np.max(tokens[:]))
        if configured <= 0:
            return largest + 1
        if largest >= configured:
            position = int(np.argmax(tokens[:] >= configured))
            raise ConfigError(
                f"config model.vocab_size = {configured}, but {path} holds token id {int(tokens[position])} "
                f"(token {position}): raise model.vocab_size above {largest} or set it to 0 to derive it from the data"
            )
        return configured
    if configured <= 0:
        return BYTE_VOCAB
    if configured < BYTE_VOCAB:
        source = path or "the default text"
        raise ConfigError(
            f"config model.vocab_size = {configured} is below 256, but {source} is byte-level (token ids 0..255): "
            "set it to 0 (derive) or at least 256"
        )
    return configured


class ArrayReader:
    """Reads a token array front to back; its position is a token offset (a ``.bin``: no line structure)."""

    def __init__(self, tokens: TokenArray | np.ndarray) -> None:
        self.tokens = tokens
        self.position = 0

    def read(self, count: int) -> np.ndarray | None:
        """The next ``count`` tokens, or None when fewer are left (the tail is dropped)."""
        if self.position + count > len(self.tokens):
            return None
        window = np.array(self.tokens[self.position : self.position + count])
        self.position += count
        return window

    def skip(self, count: int) -> bool:
        """Move past ``count`` tokens without reading them; False when fewer are left."""
        if self.position + count > len(self.tokens):
            return False
        self.position += count
        return True

    def restart(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


class JsonlReader:
    """Reads a ``.jsonl`` file's byte tokens line by line, never holding more than one line.

    Its position is (byte offset of the current line, its line number, tokens of it consumed), so a resume
    seeks to that line instead of re-reading the file.
    """

    def __init__(self, path: str) -> None:
        _file_size(path)
        self.path = path
        self._file: BinaryIO | None = None
        self.restart()

    def restart(self) -> None:
        self.line_offset, self.line_no, self.consumed = 0, 0, 0
        self._line: np.ndarray = np.zeros(0, dtype=np.uint8)
        self._next_offset = 0

    def _open(self) -> BinaryIO:
        if self._file is None:
            self._file = open(self.path, "rb")
        return self._file

    def _next_line(self) -> bool:
        """Make the next non-blank line current; False at the end of the file."""
        file = self._open()
        file.seek(self._next_offset)
        while True:
            offset = file.tell()
            raw = file.readline()
            if not raw:
                return False
            self.line_no += 1
            tokens = jsonl_line_tokens(self.path, self.line_no, raw)
            if tokens is not None:
                self.line_offset, self._next_offset = offset, file.tell()
                self._line, self.consumed = tokens, 0
                return True

    def read(self, count: int) -> np.ndarray | None:
        parts: list[np.ndarray] = []
        needed = count
        while needed:
            if self.consumed == len(self._line) and not self._next_line():
                return None
            take = min(needed, len(self._line) - self.consumed)
            parts.append(self._line[self.consumed : self.consumed + take])
            self.consumed += take
            needed -= take
        return np.concatenate(parts)

    def skip(self, count: int) -> bool:
        return self.read(count) is not None

    def state_dict(self) -> dict[str, Any]:
        return {"line_offset": self.line_offset, "line_no": self.line_no, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restart()
        if int(state["line_no"]) == 0:  # nothing read yet
            return
        self._next_offset, self.line_no = int(state["line_offset"]), int(state["line_no"]) - 1
        self._next_line()
        self.consumed = int(state["consumed"])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_file": None}
