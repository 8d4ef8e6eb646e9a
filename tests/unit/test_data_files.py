"""Real data files for the LLM trainer: .bin token files and .jsonl, the vocabulary rule, bad files refused in
one line. (The trainer on them: tests/e2e/test_data_files.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.token_data import write_bad_jsonl
from torchtitan_rng.config import ConfigError, parse_args
from torchtitan_rng.models.llama.dataset import build_text_dataset, load_tokens
from torchtitan_rng.models.llama.spec import build_llama


def _config(path: Path, *overrides: str):
    return parse_args(["--training.dataset_path", str(path), *overrides])


def test_vocabulary_follows_the_data(token_files: dict[str, Path]) -> None:
    assert build_llama(_config(token_files["bin"])).embed.num_embeddings == 1000  # largest id 999, + 1
    assert build_llama(_config(token_files["bin"], "--model.vocab_size", "-1")).output.out_features == 1000
    assert build_llama(_config(token_files["bin"], "--model.vocab_size", "1024")).embed.num_embeddings == 1024
    assert build_llama(_config(token_files["jsonl"])).embed.num_embeddings == 256


def test_bin_is_memory_mapped_uint16_and_jsonl_is_text_bytes(token_files: dict[str, Path]) -> None:
    tokens = load_tokens(str(token_files["bin"]))
    assert len(tokens) == 40_000
    assert np.array_equal(tokens[:], np.fromfile(token_files["bin"], dtype="<u2"))
    assert isinstance(tokens[:], np.memmap)
    records = [json.loads(line) for line in token_files["jsonl"].read_text().splitlines() if line.strip()]
    expected = b"".join(record["text"].encode() + b"\n" for record in records)
    assert load_tokens(str(token_files["jsonl"])).tobytes() == expected
    sample = build_text_dataset(_config(token_files["bin"]))[5]
    assert sample["input"].dtype.is_floating_point is False and int(sample["labels"].max()) < 1000


@pytest.mark.parametrize("case, expected", [
    ("missing", "cannot read '{p}' (No such file or directory)"),
    ("odd", "{p} has 7 bytes, not a whole number of 2-byte tokens"),
    ("not_json", "{p} line 3: not valid JSON (Expecting value)"),
    ("no_text", '{p} line 3: no "text" field holding a string'),
    ("text_not_string", '{p} line 3: no "text" field holding a string'),
])
def test_bad_file_is_one_line_naming_file_and_line(tmp_path: Path, case: str, expected: str) -> None:
    if case == "missing":
        path = tmp_path / "absent.bin"
    elif case == "odd":
        path = tmp_path / "odd.bin"
        path.write_bytes(b"\x01" * 7)
    else:
        path = write_bad_jsonl(tmp_path, {"not_json": "not json", "no_text": '{"body": "x"}',
                                     "text_not_string": '{"text": 3}'}[case])
    with pytest.raises(ConfigError) as err:
        config = _config(path)
        build_llama(config)
        build_text_dataset(config)
    assert expected.format(p=path) in str(err.value)
    assert "\n" not in str(err.value)


def test_token_outside_the_vocabulary_is_named(token_files: dict[str, Path]) -> None:
    with pytest.raises(ConfigError) as err:
        build_llama(_config(token_files["bin"], "--model.vocab_size", "999"))
    assert str(err.value) == (
        f"config model.vocab_size = 999, but {token_files['bin']} holds token id 999 (token 13333): raise "
        "model.vocab_size above 999 or set it to 0 to derive it from the data"
    )
    with pytest.raises(ConfigError, match="is below 256, but .*docs.jsonl is byte-level"):
        build_llama(_config(token_files["jsonl"], "--model.vocab_size", "128"))


