"""Real data files for the LLM trainer: .bin token files and .jsonl, the vocabulary rule, bad files, exact resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from launch import compare, stop_and_resume, together, train
from token_data import write_jsonl, write_token_file
from torchtitan_rng.config import ConfigError, parse_args
from torchtitan_rng.loss_log import read_loss_log
from torchtitan_rng.models.llama.dataset import build_text_dataset, load_tokens
from torchtitan_rng.models.llama.spec import build_llama


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("data")
    return {"bin": write_token_file(folder / "train.bin"), "jsonl": write_jsonl(folder / "docs.jsonl")}


def _config(path: Path, *overrides: str):
    return parse_args(["--training.dataset_path", str(path), *overrides])


def test_vocabulary_follows_the_data(data: dict[str, Path]) -> None:
    assert build_llama(_config(data["bin"])).embed.num_embeddings == 1000  # largest id 999, + 1
    assert build_llama(_config(data["bin"], "--model.vocab_size", "-1")).output.out_features == 1000
    assert build_llama(_config(data["bin"], "--model.vocab_size", "1024")).embed.num_embeddings == 1024
    assert build_llama(_config(data["jsonl"])).embed.num_embeddings == 256


def test_bin_is_memory_mapped_uint16_and_jsonl_is_text_bytes(data: dict[str, Path]) -> None:
    tokens = load_tokens(str(data["bin"]))
    assert len(tokens) == 40_000
    assert np.array_equal(tokens[:], np.fromfile(data["bin"], dtype="<u2"))
    assert isinstance(tokens[:], np.memmap)
    records = [json.loads(line) for line in data["jsonl"].read_text().splitlines() if line.strip()]
    expected = b"".join(record["text"].encode() + b"\n" for record in records)
    assert load_tokens(str(data["jsonl"])).tobytes() == expected
    sample = build_text_dataset(_config(data["bin"]))[5]
    assert sample["input"].dtype.is_floating_point is False and int(sample["labels"].max()) < 1000


def _bad_jsonl(folder: Path, line: str) -> Path:
    path = folder / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n' + line + "\n")
    return path


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
        path = _bad_jsonl(tmp_path, {"not_json": "not json", "no_text": '{"body": "x"}',
                                     "text_not_string": '{"text": 3}'}[case])
    with pytest.raises(ConfigError) as err:
        config = _config(path)
        build_llama(config)
        build_text_dataset(config)
    assert expected.format(p=path) in str(err.value)
    assert "\n" not in str(err.value)


def test_token_outside_the_vocabulary_is_named(data: dict[str, Path]) -> None:
    with pytest.raises(ConfigError) as err:
        build_llama(_config(data["bin"], "--model.vocab_size", "999"))
    assert str(err.value) == (
        f"config model.vocab_size = 999, but {data['bin']} holds token id 999 (token 13333): raise "
        "model.vocab_size above 999 or set it to 0 to derive it from the data"
    )
    with pytest.raises(ConfigError, match="is below 256, but .*docs.jsonl is byte-level"):
        build_llama(_config(data["jsonl"], "--model.vocab_size", "128"))


@pytest.mark.e2e
def test_trainer_refuses_out_of_vocabulary_and_bad_lines_in_one_line(data: dict[str, Path], tmp_path: Path) -> None:
    proc = train(tmp_path / "a", "--training.dataset_path", str(data["bin"]), "--model.vocab_size", "512", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: config model.vocab_size = 512, but {data['bin']} holds token id {_first_at_least(data['bin'], 512)[0]} "
        f"(token {_first_at_least(data['bin'], 512)[1]}): raise model.vocab_size above 999 or set it to 0 to derive "
        "it from the data"
    ]
    bad = _bad_jsonl(tmp_path, "not json")
    proc = train(tmp_path / "b", "--training.dataset_path", str(bad), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: config training.dataset_path: {bad} line 3: not valid JSON (Expecting value); each line must be "
        "an object with a \"text\" string"
    ]


def _first_at_least(path: Path, vocab: int) -> tuple[int, int]:
    tokens = np.fromfile(path, dtype="<u2")
    position = int(np.argmax(tokens >= vocab))
    return int(tokens[position]), position


STEPS = ("--training.steps", "8")


@pytest.fixture(scope="module")
def bin_runs(data: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The .bin file: uninterrupted, beside the same run stopped at 4 and resumed to 8."""
    run_a, run_b = tmp_path_factory.mktemp("bin_A"), tmp_path_factory.mktemp("bin_B")
    _uninterrupted_beside_resumed(run_a, run_b, "--training.dataset_path", str(data["bin"]))
    return run_a, run_b


def _uninterrupted_beside_resumed(run_a: Path, run_b: Path, *overrides: str, nproc: int = 1) -> None:
    together(lambda: train(run_a, *overrides, *STEPS, nproc=nproc),
             lambda: stop_and_resume(run_b, 4, 8, *overrides, interval=4, nproc=nproc))


@pytest.mark.e2e
def test_bin_resumes_exactly(bin_runs: tuple[Path, Path]) -> None:
    bin_uninterrupted, bin_resumed = bin_runs
    result = compare(bin_uninterrupted, bin_resumed)
    assert result.returncode == 0, result.stdout
    assert sorted(read_loss_log(bin_resumed)) == list(range(1, 9))


@pytest.mark.e2e
def test_bin_control_without_the_data_position_differs(data: dict[str, Path], bin_runs: tuple[Path, Path],
                                                       tmp_path: Path) -> None:
    """The comparison catches a real divergence: the same resume with the dataloader's state left out."""
    bin_uninterrupted, bin_resumed = bin_runs
    shutil.copytree(bin_resumed / "checkpoint" / "step-4", tmp_path / "checkpoint" / "step-4")
    train(tmp_path, "--training.dataset_path", str(data["bin"]), *STEPS, "--checkpoint.enable",
          "--checkpoint.interval", "4", "--lr_scheduler.total_steps", "8",
          "--checkpoint.exclude_from_loading", "dataloader")
    result = compare(bin_uninterrupted, tmp_path, "--only-common-steps")
    assert result.returncode == 1
    assert result.stdout.startswith("first differing step 5:"), result.stdout


@pytest.mark.e2e
def test_jsonl_resumes_exactly(data: dict[str, Path], tmp_path: Path) -> None:
    _uninterrupted_beside_resumed(tmp_path / "A", tmp_path / "B", "--training.dataset_path", str(data["jsonl"]))
    result = compare(tmp_path / "A", tmp_path / "B")
    assert result.returncode == 0, result.stdout


@pytest.mark.e2e
def test_bin_two_processes_resume_exactly(data: dict[str, Path], tmp_path: Path) -> None:
    _uninterrupted_beside_resumed(tmp_path / "A", tmp_path / "B", "--training.dataset_path", str(data["bin"]),
                                  nproc=2)
    result = compare(tmp_path / "A", tmp_path / "B")
    assert result.returncode == 0, result.stdout
