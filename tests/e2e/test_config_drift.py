"""Never silently inexact: a resume that changes what the run trains on, damaged checkpoint files and a run
restarted over a history are refused (exit 2, nothing written); an explicit opt-in goes on with a WARNING
and the config's values; an unchanged resume stays exact and quiet. Also: ranks die with their launcher.

One stopped run (4 of 20 steps, horizon pinned) serves every refused resume: a refusal exits before training.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.launch import EVERY_STEP, compare, start, train, wait_for_log_lines
from torchtitan_rng.launch import run_lock
from torchtitan_rng.loss_log import read_loss_log
from torchtitan_rng.lr_scheduler import WarmupDecay


STOP, TOTAL = 4, 20
CKPT = ("--checkpoint.enable", "--checkpoint.interval", "2")
LR = 3e-3  # llama_debug.toml


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
            for path in sorted(folder.rglob("*"))}


def _refused(proc: subprocess.CompletedProcess, lines: int = 1) -> list[str]:
    """Exit 2, ``lines`` lines on stderr each starting with ``error:``, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stdout + proc.stderr
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == lines and all(line.startswith("error: ") for line in errors), proc.stderr
    return errors


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dump = tmp_path_factory.mktemp("stopped")
    train(dump, "--training.steps", str(STOP), "--lr_scheduler.total_steps", str(TOTAL), *CKPT)
    return dump


@pytest.fixture
def dump(stopped: Path, tmp_path: Path) -> Path:
    """A copy of the stopped run for a test that may change it."""
    copy = tmp_path / "dump"
    shutil.copytree(stopped, copy)
    return copy


def test_unchanged_resume_is_exact_and_quiet(llama_uninterrupted: Path, dump: Path) -> None:
    """The documented stop-and-resume: stopped with --lr_scheduler.total_steps 20, resumed with only
    --training.steps 20 (total_steps 0 means training.steps): the same horizon, no word, bitwise equal."""
    proc = train(dump, "--training.steps", str(TOTAL), *CKPT)
    assert "WARNING" not in proc.stdout + proc.stderr and "note:" not in proc.stdout, proc.stdout
    result = compare(llama_uninterrupted, dump)
    assert result.returncode == 0, result.stdout


TABLE = {  # the rows: each resumed silently and differed from the first resumed step
    "debug.seed": ("7", 0, 7),
    "training.local_batch_size": ("4", 8, 4),
    "training.seq_len": ("32", 64, 32),
    "lr_scheduler.warmup_steps": ("5", 2, 5),
    "data.num_samples": ("100", 64, 100),
    "optimizer.lr": ("1e-4", LR, 1e-4),
}


def test_changed_keys_are_refused_one_line_each(stopped: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.txt"
    other.write_bytes(Path(run_lock.__file__).read_bytes() * 20)
    before = _snapshot(stopped)
    overrides = [arg for key, (value, _, _) in TABLE.items() for arg in (f"--{key}", value)]
    proc = train(stopped, "--training.steps", "8", "--lr_scheduler.total_steps", str(TOTAL), *CKPT, *overrides,
                 "--training.dataset_path", str(other), check=False)
    errors = _refused(proc, lines=len(TABLE) + 1)
    checkpoint = stopped / "checkpoint" / f"step-{STOP}"
    by_key = {line.removeprefix("error: ").split(" = ")[0]: line for line in errors}
    assert sorted(by_key) == sorted([*TABLE, "training.dataset_path"])
    for key, (_, saved, new) in TABLE.items():
        assert by_key[key].startswith(f"error: {key} = {new!r} but checkpoint {checkpoint} was trained with {saved!r}: "
                                      f"resume with the saved value, or pass --checkpoint.allow_config_change {key} "), by_key[key]
    assert by_key["training.dataset_path"].startswith(
        f"error: training.dataset_path = {str(other)!r} is other data than checkpoint {checkpoint} was trained with "
        f"(saved: the built-in text, samples 64; now: {str(other)!r}, blake2b_ends ")
    assert f"bytes {other.stat().st_size}, samples " in by_key["training.dataset_path"]
    assert _snapshot(stopped) == before  # loss log byte for byte, checkpoints untouched


@pytest.mark.parametrize("extension", [(), ("--lr_scheduler.total_steps", "24")], ids=["past_pinned", "new_horizon"])
def test_extending_past_the_horizon_is_refused(stopped: Path, extension: tuple[str, ...]) -> None:
    """The issue's row ran steps past the schedule's end at lr 0.0, silently."""
    before = _snapshot(stopped)
    args = ("--lr_scheduler.total_steps", str(TOTAL), *extension)
    error = _refused(train(stopped, "--training.steps", "24", *CKPT, *args, check=False))[0]
    expected = ("error: training.steps = 24 runs past lr_scheduler.total_steps = 20" if not extension else
                f"error: lr_scheduler.total_steps = 24 but checkpoint {stopped / 'checkpoint' / f'step-{STOP}'} "
                "was trained with 20")
    assert error.startswith(expected) and error.endswith(
        "pass --checkpoint.allow_config_change lr_scheduler.total_steps to continue with the new one (the run is "
        "then no longer exact)"), error
    assert _snapshot(stopped) == before


def test_refused_by_run_train_sh_before_any_rank_starts(stopped: Path) -> None:
    before = _snapshot(stopped)
    proc = train(stopped, "--training.steps", "8", "--lr_scheduler.total_steps", str(TOTAL), *CKPT, "--debug.seed", "7",
                 via_run_train=True, check=False)
    assert _refused(proc)[0].startswith("error: debug.seed = 7 but checkpoint ")
    assert "rank" not in proc.stdout.lower() and _snapshot(stopped) == before


def _lr_bits(dump: Path) -> dict[int, str]:
    return {step: struct.pack("<d", record["lr"]).hex() for step, record in read_loss_log(dump).items()}


def test_opt_in_warns_and_follows_the_config(dump: Path) -> None:
    """Allowed: a WARNING per key, and the learning rate of every resumed step is the new config's schedule
    (neither the checkpoint's base lr nor its horizon)."""
    horizon, lr = 8, 1e-4
    proc = train(dump, "--training.steps", str(horizon), *CKPT, "--optimizer.lr", str(lr), "--lr_scheduler.total_steps",
                 str(horizon), "--checkpoint.allow_config_change", "optimizer.lr,lr_scheduler.total_steps")
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("WARNING")]
    assert [line.split(" = ")[0] for line in warnings] == ["WARNING: lr_scheduler.total_steps", "WARNING: optimizer.lr"]
    schedule = WarmupDecay(warmup_steps=2, total_steps=horizon, decay_type="linear", min_lr_factor=0.0)
    expected = {step: struct.pack("<d", lr * schedule(step - 1)).hex() for step in range(STOP + 1, horizon + 1)}
    logged = _lr_bits(dump)
    assert {step: logged[step] for step in expected} == expected
    # Control: the checkpoint's own curve (lr 3e-3, horizon 20) differs at every resumed step.
    saved = WarmupDecay(warmup_steps=2, total_steps=TOTAL, decay_type="linear", min_lr_factor=0.0)
    assert all(struct.pack("<d", LR * saved(step - 1)).hex() != expected[step] for step in expected)


@pytest.mark.parametrize("via_run_train", [False, True], ids=["train.py", "run_train.sh"])
def test_flipped_bit_in_the_newest_shard_is_refused(dump: Path, via_run_train: bool) -> None:
    """By rank 0 (train.py), or by the launcher before any rank starts (run_train.sh). The advice works when
    followed: the damaged checkpoint moved out of the folder, the same command resumes from the one before it
    (control: resuming that one with --checkpoint.load_step instead is refused, as it would save over the
    damaged one)."""
    damaged = dump / "checkpoint" / f"step-{STOP}"
    shard = damaged / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    before = _snapshot(dump)
    command = ("--training.steps", "8", "--lr_scheduler.total_steps", str(TOTAL), *CKPT)
    error = _refused(train(dump, *command, via_run_train=via_run_train, check=False))[0]
    assert error == (f"error: checkpoint {damaged} is damaged: __0_0.distcp does not match the checksum written at "
                     "save (its content changed); move it out of the folder (a resume then picks the newest "
                     "checkpoint before it), or restore it from a copy")
    assert _snapshot(dump) == before
    if via_run_train:
        return
    older = _refused(train(dump, *command, "--checkpoint.load_step", "2", check=False))[0]
    assert f"would save over the existing checkpoints {STOP}" in older
    damaged.rename(dump / "damaged")
    assert f"resumed from {dump / 'checkpoint' / 'step-2'} at step 2" in train(dump, *command).stdout
    assert sorted(read_loss_log(dump)) == list(range(1, 9))


def test_a_refused_skip_is_not_announced_as_going_on(dump: Path) -> None:
    """A skip added at a resume for a step the checkpoint has trained: the refusal alone, no note before it saying
    the run goes on with the new value (tests/e2e/test_spikes.py shows the note where the resume goes on)."""
    before = _snapshot(dump)
    proc = train(dump, "--training.steps", "8", "--lr_scheduler.total_steps", str(TOTAL), *CKPT,
                 "--training.skip_steps", "3", check=False)
    error = _refused(proc)[0]
    assert error.startswith(f"error: training.skip_steps adds step(s) 3, which checkpoint {dump / 'checkpoint'}")
    assert "going on" not in proc.stdout + proc.stderr and "training.skip_steps = '3'" not in proc.stdout
    assert _snapshot(dump) == before


@pytest.mark.parametrize("nproc", [1, 2], ids=["train.py", "run_train.sh"])
def test_no_restart_over_a_history(stopped: Path, nproc: int) -> None:
    """The shipped configs leave checkpoint.enable off: "the same command again" must not train from step 1
    over the saved run and append a second history."""
    before = _snapshot(stopped)
    error = _refused(train(stopped, "--training.steps", str(TOTAL), nproc=nproc, check=False))[0]
    assert error == (f"error: dump folder {stopped} already holds a run (loss_log.jsonl; checkpoints 2, 4) and "
                     "checkpoint.enable is off, so this run would start again from step 1 over it: add "
                     "--checkpoint.enable to resume it, or pass another --job.dump_folder (or move this one away) "
                     "to start afresh")
    assert _snapshot(stopped) == before


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := [pid for pid in pids if run_lock.pid_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling interval of the watch, not a synchronisation delay
    return alive


def test_ranks_die_with_a_killed_launcher_and_a_resubmission_resumes(tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    args = ("--training.steps", "8", "--lr_scheduler.total_steps", "8", *CKPT, *EVERY_STEP)
    launcher = start(dump, *args, nproc=2)
    try:
        wait_for_log_lines(dump, 3, launcher)
        lock = [json.loads(line) for line in run_lock.lock_path(dump).read_text().splitlines()]
        assert lock[0]["pid"] == launcher.pid
        ranks = sorted(entry["pid"] for entry in lock[1:])
        assert len(ranks) == 2 and all(run_lock.pid_alive(pid) for pid in ranks)
        launcher.send_signal(signal.SIGKILL)
        launcher.communicate()
        assert _wait_gone(ranks, timeout=10) == []
    finally:
        for pid in [launcher.pid, *(ranks if "ranks" in locals() else [])]:
            if run_lock.pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    proc = train(dump, *args, nproc=2)
    assert "in use by another run" not in proc.stderr
    assert sorted(read_loss_log(dump))[-1] == 8
