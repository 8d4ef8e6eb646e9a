"""Bad input: one line saying what is wrong and what to do, exit 2, no traceback, nothing of the user's
touched. Also the checkpoints that do not fit a run (process count, device type, no RNG state), crafted
pickles (never executed), and two runs on one dump folder."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from launch import compare, start, train, wait_for_log_lines
from torchtitan_rng.launch.run_lock import lock_path
from torchtitan_rng.checkpoint.codec import decode_state, encode_state

# The horizon is pinned: the resumes below go to step 3 or 4 on the saved run's learning-rate curve.
STEP2 = ("--checkpoint.enable", "--checkpoint.interval", "2", "--lr_scheduler.total_steps", "4")


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder under ``folder`` with a hash of its content."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        for path in sorted(folder.rglob("*"))
    }


def _assert_refused(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 2, exactly one line on stderr starting with ``error:``, holding every fragment; no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's dump folder: loss log and a complete checkpoint at step 2 from one process."""
    dump = tmp_path_factory.mktemp("saved")
    train(dump, "--training.steps", "2", *STEP2)
    return dump


@pytest.fixture
def user_dump(saved: Path, tmp_path: Path) -> Path:
    dump = tmp_path / "dump"
    shutil.copytree(saved, dump)
    return dump


# --- configuration (run_train.sh: the launcher refuses before any rank starts) ----------------------------

CONFIG_CASES = {
    "unknown key": (("--training.stepz", "3"), ("unknown config key 'training.stepz'", "valid keys in [training]")),
    "unknown section": (("--trainin.steps", "3"), ("unknown config section 'trainin'", "valid sections")),
    "wrong type": (("--training.steps", "many"), ("training.steps", "expected an integer")),
    "steps <= 0": (("--training.steps", "0"), ("training.steps = 0 is out of range", ">= 1")),
    "interval <= 0": (("--checkpoint.interval", "-5"), ("checkpoint.interval = -5 is out of range",)),
    "keep 1 while async": (("--checkpoint.keep_latest_k", "1", "--checkpoint.async_mode", "async"),
                           ("keep_latest_k = 1 cannot be used", "async")),
    "unknown signal": (("--signals.checkpoint_on", "SIGTERM,SIGKILL"), ("signals.checkpoint_on has 'SIGKILL'",)),
    "load_step missing": (("--checkpoint.enable", "--checkpoint.load_step", "7"),
                          ("checkpoint.load_step 7 not found", "complete checkpoints there: 2")),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_bad_config_is_one_line(user_dump: Path, case: str) -> None:
    overrides, fragments = CONFIG_CASES[case]
    before = _snapshot(user_dump)
    _assert_refused(train(user_dump, *overrides, check=False), *fragments)
    assert _snapshot(user_dump) == before


def test_missing_config_file(user_dump: Path) -> None:
    before = _snapshot(user_dump)
    _assert_refused(train(user_dump, config="does_not_exist", check=False), "does_not_exist.toml' does not exist")
    assert _snapshot(user_dump) == before


def test_bad_config_through_run_train_sh(user_dump: Path) -> None:
    """The same refusal from the launcher, before torchrun starts any rank."""
    before = _snapshot(user_dump)
    proc = train(user_dump, "--training.steps", "0", nproc=2, check=False)
    _assert_refused(proc, "training.steps = 0 is out of range")
    assert "rank" not in proc.stdout.lower() and _snapshot(user_dump) == before


# --- damaged checkpoints ------------------------------------------------------------------------------

def _empty_newer_step(ckpt: Path) -> None:
    (ckpt / "step-9").mkdir()


def _truncate_shard(ckpt: Path) -> None:
    shard = ckpt / "step-2" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _delete_shard(ckpt: Path) -> None:
    (ckpt / "step-2" / "__0_0.distcp").unlink()


DAMAGE: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "empty step folder": (_empty_newer_step, ("step-9 is incomplete (no .metadata", "--checkpoint.load_step")),
    "truncated shard": (_truncate_shard, ("shard file __0_0.distcp is truncated",)),
    "missing shard": (_delete_shard, ("shard file __0_0.distcp is missing",)),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_checkpoint_is_refused(user_dump: Path, case: str) -> None:
    damage, fragments = DAMAGE[case]
    damage(user_dump / "checkpoint")
    before = _snapshot(user_dump)
    _assert_refused(train(user_dump, "--training.steps", "4", *STEP2, check=False), *fragments)
    assert _snapshot(user_dump) == before


def test_other_model_shape(user_dump: Path) -> None:
    before = _snapshot(user_dump)
    _assert_refused(train(user_dump, "--model.flavor", "small", "--training.steps", "4", *STEP2,
                          "--checkpoint.allow_config_change", "model.flavor", check=False),
                    "does not fit this run", "Size mismatch", "model.embed.weight")
    assert _snapshot(user_dump) == before


def test_compare_losses_on_a_log_that_is_not_jsonl(tmp_path: Path, saved: Path) -> None:
    bad = tmp_path / "loss_log.jsonl"
    bad.write_text('{"step": 1, "loss": 2.5}\nnot json at all\n')
    before = bad.read_bytes()
    _assert_refused(compare(saved, bad), f"{bad}:2: not a loss-log line")
    assert bad.read_bytes() == before


# --- checkpoints that do not fit the run: process count, device type, no RNG state -----------------

def test_other_world_size_refused_naming_both_sizes(user_dump: Path) -> None:
    before = _snapshot(user_dump)
    _assert_refused(train(user_dump, "--training.steps", "4", *STEP2, nproc=2, check=False),
                    "saved by 1 processes and this run has 2", "--checkpoint.on_world_size_change reseed")
    assert _snapshot(user_dump) == before


def test_other_world_size_with_reseed_warns_and_continues(user_dump: Path) -> None:
    proc = train(user_dump, "--training.steps", "3", *STEP2, "--checkpoint.on_world_size_change", "reseed", nproc=2)
    assert "WARNING: resuming" in proc.stdout and "no longer exact" in proc.stdout
    assert [json.loads(line)["step"] for line in (user_dump / "loss_log.jsonl").read_text().splitlines()] == [1, 2, 3]


def _rewrite_checkpoint(ckpt: Path, tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Load a real DCP checkpoint, edit its state, write it back as a real DCP checkpoint."""
    staged = tmp_path / "staged.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(ckpt, staged)  # our own checkpoint: trusted
        state = torch.load(staged, weights_only=False)
        edit(state)
        shutil.rmtree(ckpt)
        dcp.save(state, checkpoint_id=str(ckpt))


def _edit_rank_blob(state: dict[str, Any], **changes: Any) -> None:
    blob = decode_state(state["train_state"]["rank_0"])
    blob.update(changes)
    state["train_state"]["rank_0"] = encode_state(blob)


def test_other_device_type(user_dump: Path, tmp_path: Path) -> None:
    """A checkpoint whose per-rank state says CUDA (16-byte Philox state), resumed on this CPU run."""
    def to_cuda(state: dict[str, Any]) -> None:
        rng = decode_state(state["train_state"]["rank_0"])["rng"]
        rng.update(device_type="cuda", device=torch.zeros(16, dtype=torch.uint8))
        _edit_rank_blob(state, device_type="cuda", rng=rng)

    _rewrite_checkpoint(user_dump / "checkpoint" / "step-2", tmp_path, to_cuda)
    before = _snapshot(user_dump)
    _assert_refused(train(user_dump, "--training.steps", "3", *STEP2, check=False),
                    "was saved on cuda and this run is on cpu", "--checkpoint.allow_device_type_change")
    assert _snapshot(user_dump) == before
    proc = train(user_dump, "--training.steps", "3", *STEP2, "--checkpoint.allow_device_type_change")
    assert "WARNING" in proc.stdout and "CPU, NumPy and Python streams restored" in proc.stdout


def test_checkpoint_without_rng_state(user_dump: Path, tmp_path: Path) -> None:
    _rewrite_checkpoint(user_dump / "checkpoint" / "step-2", tmp_path, lambda s: s["train_state"].pop("rank_0"))
    before = _snapshot(user_dump)
    _assert_refused(train(user_dump, "--training.steps", "3", *STEP2, "--checkpoint.strict_rng", check=False),
                    "holds no RNG state", "strict_rng")
    assert _snapshot(user_dump) == before
    proc = train(user_dump, "--training.steps", "3", *STEP2)
    assert "WARNING: checkpoint" in proc.stdout and "holds no RNG state" in proc.stdout


# --- crafted pickles are never executed ------------------------------------------------------------

class _CreatesFile:
    """Unpickling this opens (creates) a file: the stand-in for any code a crafted checkpoint runs."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def test_pickle_payload_in_a_non_tensor_item(user_dump: Path, tmp_path: Path) -> None:
    marker = tmp_path / "payload_ran"
    ckpt = user_dump / "checkpoint" / "step-2"

    def plant(state: dict[str, Any]) -> None:
        state["train_state"]["rank_0"] = _CreatesFile(marker)

    _rewrite_checkpoint(ckpt, tmp_path, plant)
    _assert_refused(train(user_dump, "--training.steps", "3", *STEP2, check=False),
                    "refusing to load checkpoint item 'train_state.rank_0'", "not plain data")
    assert not marker.exists()
    # Control: the payload is real; DCP's own load planner runs it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"train_state": {"rank_0": b""}}, checkpoint_id=str(ckpt))
    assert marker.exists()


def test_pickle_payload_as_metadata(user_dump: Path, tmp_path: Path) -> None:
    marker = tmp_path / "payload_ran"
    ckpt = user_dump / "checkpoint" / "step-2"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_CreatesFile(marker)))
    _assert_refused(train(user_dump, "--training.steps", "3", *STEP2, check=False),
                    "its .metadata is missing or damaged", "open is not part of DCP metadata")
    assert not marker.exists()
    FileSystemReader(str(ckpt)).read_metadata()  # control: DCP's own reader runs it
    assert marker.exists()


# --- one run per dump folder -----------------------------------------------------------------------

def test_second_run_on_the_same_dump_folder_refuses(tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    first = start(dump, "--training.steps", "8")
    try:
        wait_for_log_lines(dump, 1, first)
        first.send_signal(signal.SIGSTOP)  # alive and holding the lock until SIGCONT: no race with its end
        for nproc in (1, 2):  # python train.py (rank 0 takes the lock) and run_train.sh (the launcher does)
            line = _assert_refused(train(dump, check=False, nproc=nproc), "is in use by another run")
            assert f"pid {first.pid} on host {socket.gethostname()}" in line
    finally:
        first.send_signal(signal.SIGCONT)
        out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    logged = (dump / "loss_log.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["step"] for line in logged) == list(range(1, 9))  # the refused ones wrote nothing
    assert not lock_path(dump).exists()


def test_stale_lock_of_a_dead_process_does_not_block(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dump = tmp_path / "dump"
    dump.mkdir()
    lock_path(dump).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(),
                                           "started": "earlier", "token": "x"}))
    train(dump, "--training.steps", "1")
    assert not lock_path(dump).exists()
