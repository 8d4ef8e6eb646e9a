"""The loss-log and tensor-fingerprint readers on damaged and hostile files: compare_losses answers one line and exit
2 (never a traceback, a hang or a memory blow-up), a cut last line of a fingerprint file counts as absent, and a run
refuses to append to a loss log it cannot read.

compare_losses runs as its own process (no torch to import: a fraction of a second), under an address-space limit
and a time limit, so a reader that loops or reads a device without end fails the test instead of stalling it."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch import REPO, run_env
from tests.unit.test_tensor_locator import synthetic, write
from torchtitan_rng.config import parse_args
from torchtitan_rng.diagnosis.locator import prints_path
from torchtitan_rng.launch import preflight
from torchtitan_rng.loss_log import LossLogError

MEMORY_LIMIT = 2 * 2**30  # bytes: far above what reading these few lines needs


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def compare(a: Path, b: Path) -> subprocess.CompletedProcess[str]:
    # The time limit only turns a hang into a failure; a passing run takes well under a second.
    return subprocess.run([sys.executable, "-m", "torchtitan_rng.compare_losses", str(a), str(b)], cwd=REPO,
                          capture_output=True, text=True, env=run_env(), timeout=120, preexec_fn=_limit_memory)


def assert_one_line(proc: subprocess.CompletedProcess[str], *expected: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for text in expected:
        assert text in proc.stderr, proc.stderr


def _loss_log(folder: Path, steps: int = 4) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "loss_log.jsonl").write_text("".join(json.dumps({"step": step, "loss": 3.0 - step / 2}) + "\n"
                                                   for step in range(1, steps + 1)))
    return folder


def _run(folder: Path) -> Path:
    """A dump folder with a loss log and the synthetic fingerprints of two ranks."""
    return _loss_log(write(folder, synthetic()))


def _replace_line(folder: Path, text: str, rank: int = 0) -> Path:
    """Line 2 of the rank's file replaced by ``text`` (a whole line, newline included)."""
    path = prints_path(folder, rank)
    lines = path.read_text().splitlines(keepends=True)
    lines[1] = text + "\n"
    path.write_text("".join(lines))
    return path


def _with(**fields: object) -> str:
    return json.dumps({**_rank_line_template(), **fields})


def _rank_line_template() -> dict[str, object]:
    return synthetic()[2][0]


MALFORMED = {
    "entering-list": (_with(entering=[1, 2]), "entering is not a table"),
    "grad-string": (_with(grad="x"), "grad is not a table of hashes"),
    "modules-pair": (_with(modules=[["x", 1]]), "modules is not a list"),
    "world_size-string": (_with(world_size="1"), "world_size '1' is not a positive integer"),
    "world_size-0": (_with(world_size=0), "world_size 0 is not a positive integer"),
    "world_size-negative": (_with(world_size=-3), "world_size -3 is not a positive integer"),
    "world_size-without-rank": (_with(world_size=1), "world_size 1 has no rank 1"),
    "step-1e400": (_with().replace('"step": 2', '"step": 1e400'), "the number 1e400 is out of float range"),
    "step-float": (_with(step=2.0), "no integer step"),
    "batch-ints": (_with(batch=[1, 2]), "batch is not a list"),
    "sharded-ints": (_with(sharded=[1]), "sharded is not a list of names"),
    "hash-400-digits": (_with().replace('"step": 2', '"step": 2, "param": {"x": ' + "9" * 400 + "}"),
                        "is out of range"),
    "deep-nesting": ('{"step": 2, "world_size": 2, "x": ' + "[" * 5000 + "]" * 5000 + "}", "nested too deep"),
    "not-an-object": ("[1, 2]", "not a JSON object"),
    "not-json": ("{'step': 2}", "not JSON"),
}


@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_a_malformed_fingerprint_line_is_one_line(tmp_path: Path, case: str) -> None:
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    assert compare(a, b).returncode == 0  # the control: the untouched files compare
    text, why = MALFORMED[case]
    path = _replace_line(b, text, rank=1)
    assert_one_line(compare(a, b), f"{path}:2: not a tensor-fingerprint line (", why)


def test_bytes_that_are_not_utf8_are_one_line(tmp_path: Path) -> None:
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    path = prints_path(b, 0)
    path.write_bytes(path.read_bytes() + b'{"step": 5, "world_size": 2, "x": "\xff\xfe"}\n')
    assert_one_line(compare(a, b), f"{path}:5: not a tensor-fingerprint line (a byte that is not UTF-8 text")
    path.write_bytes(os.urandom(4096).replace(b"\n", b"") + b"\n")
    assert_one_line(compare(a, b), f"{path}:1: not a tensor-fingerprint line (")


def test_a_cut_last_fingerprint_line_counts_as_absent(tmp_path: Path) -> None:
    """A kill cut rank 1's step 5 in half; the run was resumed over one rank, which never reopened that file."""
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    expected = compare(a, b)
    assert expected.returncode == 0
    path = prints_path(b, 1)
    whole = path.read_text()
    path.write_text(whole + '{"step": 5, "world_size": 2, "grad": {"embed.weig')
    proc = compare(a, b)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, expected.stdout, "")
    path.write_text(whole + '{"step": 5, "world_size": 2, "grad": {"embed.weig\n')  # control: a whole line
    assert_one_line(compare(a, b), f"{path}:5: not a tensor-fingerprint line (not JSON")


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _folder(path: Path) -> None:
    path.mkdir()


def _loop(path: Path) -> None:
    path.symlink_to(path.name)


NOT_FILES = {"fifo": (_fifo, "is a FIFO"), "dev-zero": (_dev_zero, "is a device"),
             "folder": (_folder, "is a folder"), "link-loop": (_loop, "is unreadable (Too many levels")}


@pytest.mark.parametrize("case", NOT_FILES, ids=list(NOT_FILES))
def test_a_rank_file_that_is_not_a_file_is_one_line(tmp_path: Path, case: str) -> None:
    """A FIFO would block the reader for ever, /dev/zero would fill the memory: both are refused unread."""
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    path = prints_path(b, 1)
    path.unlink()
    make, kind = NOT_FILES[case]
    make(path)
    assert_one_line(compare(a, b), f"{path} {kind}", "not a tensor-fingerprint file: move it away")


def test_a_file_not_named_by_a_rank_is_one_line(tmp_path: Path) -> None:
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    for name in ("rankX.jsonl", "rank01.jsonl"):
        stray = prints_path(b, 0).with_name(name)
        stray.write_text(prints_path(b, 0).read_text())
        assert_one_line(compare(a, b), f"{stray}: not a tensor-fingerprint file (the recorder writes rank0.jsonl")
        stray.unlink()


def test_a_huge_world_size_is_read_without_counting_to_it(tmp_path: Path) -> None:
    """world_size 10**12 in both runs: compared over the ranks that wrote (the reader once looped over 10**12)."""
    a, b = tmp_path / "a", tmp_path / "b"
    lines = synthetic()
    for per_rank in lines.values():
        for line in per_rank.values():
            line["world_size"] = 10**12
    _loss_log(write(a, lines))
    _loss_log(write(b, lines))
    proc = compare(a, b)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["identical: 4 steps (1..4) with bitwise-equal losses"]


LOSS_LINES = {
    "not-utf8": (b'{"step": 3, "loss": 1.5, "note": "\xff"}', "a byte that is not UTF-8 text"),
    "loss-1e400": (b'{"step": 3, "loss": 1e400}', "the number 1e400 is out of float range"),
    "loss-400-digits": (b'{"step": 3, "loss": ' + b"9" * 400 + b"}", "is out of range"),
    "step-1e400": (b'{"step": 1e400, "loss": 1.5}', "the number 1e400 is out of float range"),
    "deep-nesting": (b'{"step": 3, "loss": 1.5, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deep"),
    "loss-string": (b'{"step": 3, "loss": "1.5"}', "no numeric loss"),
    "rng-fingerprint": (b'{"step": 3, "loss": 1.5, "rng_fingerprint": [1]}', "rng_fingerprint is not a list"),
}


def _damage_loss_log(folder: Path, line: bytes) -> Path:
    path = folder / "loss_log.jsonl"
    lines = path.read_bytes().split(b"\n")
    lines[2] = line
    path.write_bytes(b"\n".join(lines))
    return path


@pytest.mark.parametrize("case", LOSS_LINES, ids=list(LOSS_LINES))
def test_a_damaged_loss_log_is_one_line(tmp_path: Path, case: str) -> None:
    a, b = _loss_log(tmp_path / "a"), _loss_log(tmp_path / "b")
    assert compare(a, b).returncode == 0  # the control
    line, why = LOSS_LINES[case]
    path = _damage_loss_log(b, line)
    assert_one_line(compare(a, b), f"{path}:3: not a loss-log line (", why)


@pytest.mark.parametrize("case", ["fifo", "dev-zero"])
def test_a_loss_log_that_is_not_a_file_is_one_line(tmp_path: Path, case: str) -> None:
    a, b = _loss_log(tmp_path / "a"), tmp_path / "b"
    b.mkdir()
    make, kind = NOT_FILES[case]
    make(b / "loss_log.jsonl")
    assert_one_line(compare(a, b), f"{b / 'loss_log.jsonl'} {kind}, not a loss-log file")


def _resumable(tmp_path: Path) -> Path:
    """A dump folder to resume: a loss log to step 6 and a complete checkpoint of step 5."""
    dump = _loss_log(tmp_path / "run", steps=6)
    step = dump / "checkpoint" / "step-5"
    step.mkdir(parents=True)
    (step / "complete.json").write_text(json.dumps({"step": 5}) + "\n")
    return dump


def _config(dump: Path):  # type: ignore[no-untyped-def]
    return parse_args(["--job.config_file", str(REPO / "train_configs" / "llama_debug.toml"), "--job.dump_folder",
                       str(dump), "--checkpoint.interval", "5", "--checkpoint.enable"])


@pytest.mark.parametrize("case", ["not-utf8", "loss-1e400", "deep-nesting"])
def test_a_run_refuses_to_append_to_a_damaged_loss_log(tmp_path: Path, case: str) -> None:
    dump = _resumable(tmp_path)
    preflight.refuse_restart_over_history(_config(dump))  # the control: the resume goes on
    path = _damage_loss_log(dump, LOSS_LINES[case][0])
    before = path.read_bytes()
    with pytest.raises(LossLogError) as err:
        preflight.refuse_restart_over_history(_config(dump))
    message = str(err.value)
    assert message.startswith(f"{path}:3: not a loss-log line (") and "\n" not in message
    assert message.endswith("this run would append to that log; repair the line or move the log away, then run the "
                            "same command again")
    assert path.read_bytes() == before


def test_a_run_refuses_a_loss_log_that_is_not_a_file(tmp_path: Path) -> None:
    dump = _resumable(tmp_path)
    (dump / "loss_log.jsonl").unlink()
    os.mkfifo(dump / "loss_log.jsonl")  # the writer would block opening it
    with pytest.raises(LossLogError, match=r"loss_log.jsonl is a FIFO, not a loss-log file"):
        preflight.refuse_restart_over_history(_config(dump))
