"""The run record's classification, checkpoint checksums and the run lock's live ranks, without training:
real files, real DCP checkpoints written in this process, real processes for the lock."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.launch import REPO
from torchtitan_rng import resume
from torchtitan_rng.checkpoint import integrity, layout, run_record
from torchtitan_rng.checkpoint.integrity import verify_integrity
from torchtitan_rng.checkpoint.codec import decode_state, encode_state
from torchtitan_rng.checkpoint.layout import CheckpointError, rank_key
from torchtitan_rng.checkpoint.train_state import TrainState
from torchtitan_rng.checkpoint.manager import CheckpointManager
from torchtitan_rng.checkpoint.states import ModelState
from torchtitan_rng.config import ConfigError, parse_args
from torchtitan_rng.launch import run_lock

CONFIG = str(REPO / "train_configs" / "llama_debug.toml")


class _Samples:
    """What a fingerprint asks of a dataset: its length."""

    def __len__(self) -> int:
        return 64


def _record(*overrides: str) -> dict:
    return resume.build_record(parse_args(["--job.config_file", CONFIG, *overrides]), _Samples())


def _check(saved: dict, current: dict, allowed: tuple[str, ...] = ()) -> list[str]:
    return run_record.check_resume(Path("ckpt/step-10"), saved, current, list(allowed))


def test_documented_stop_and_resume_is_quiet() -> None:
    """Stopped with steps 10 and the horizon pinned to 20, resumed with steps 20 (horizon = steps): the same."""
    saved = _record("--training.steps", "10", "--lr_scheduler.total_steps", "20")
    assert _check(saved, _record("--training.steps", "20")) == []


def test_keys_that_cannot_change_the_trajectory_are_quiet() -> None:
    saved = _record("--lr_scheduler.total_steps", "20")
    current = _record("--lr_scheduler.total_steps", "20", "--job.description", "x", "--metrics.log_freq", "3",
                      "--checkpoint.interval", "7", "--checkpoint.keep_latest_k", "2", "--checkpoint.folder", "c",
                      "--checkpoint.async_mode", "async", "--data.num_workers", "2", "--data.prefetch_factor", "4",
                      "--debug.rng_fingerprint", "--debug.tensor_fingerprint", "--debug.fingerprint_modules_at_step",
                      "3", "--validation.enable", "--training.steps", "15")
    assert _check(saved, current) == []


@pytest.mark.parametrize(("flag", "value", "saved_value", "new_value"), [
    ("--debug.seed", "7", 0, 7),
    ("--training.local_batch_size", "4", 8, 4),
    ("--training.seq_len", "32", 64, 32),
    ("--lr_scheduler.warmup_steps", "5", 2, 5),
    ("--data.num_samples", "100", 64, 100),
    ("--optimizer.lr", "1e-4", 3e-3, 1e-4),
    ("--model.flavor", "small", "debug", "small"),
])
def test_trajectory_keys_are_refused_one_line_each(flag: str, value: str, saved_value: object,
                                                   new_value: object) -> None:
    key = flag[2:]
    with pytest.raises(run_record.ConfigDriftError) as refused:
        _check(_record(), _record(flag, value))
    assert str(refused.value) == (
        f"{key} = {new_value!r} but checkpoint ckpt/step-10 was trained with {saved_value!r}: resume with the saved "
        f"value, or pass --checkpoint.allow_config_change {key} to continue with the new one (the run is then no "
        "longer exact)")
    warnings = _check(_record(), _record(flag, value), allowed=(key,))
    assert len(warnings) == 1 and warnings[0].startswith(f"WARNING: {key} = {new_value!r} but checkpoint ckpt/step-10")
    assert warnings[0].endswith(f"allows {key}: this run is no longer the one that was stopped")


def test_every_refused_key_named_at_once() -> None:
    with pytest.raises(run_record.ConfigDriftError) as refused:
        _check(_record(), _record("--debug.seed", "7", "--optimizer.lr", "1e-4"))
    lines = str(refused.value).splitlines()
    assert [line.split(" = ")[0] for line in lines] == ["debug.seed", "error: optimizer.lr"]


def test_extending_a_finished_run_changes_the_horizon() -> None:
    """10 steps with the horizon unpinned, then --training.steps 14: the schedule's horizon moves 10 -> 14."""
    with pytest.raises(run_record.ConfigDriftError, match=r"^lr_scheduler.total_steps = 14 but .* with 10:"):
        _check(_record("--training.steps", "10"), _record("--training.steps", "14"))


def test_running_past_a_pinned_horizon_is_refused() -> None:
    """Pinned to 10 and extended to 14 steps: steps 11-14 would train at the schedule's end (lr 0 here)."""
    saved = _record("--training.steps", "10", "--lr_scheduler.total_steps", "10")
    with pytest.raises(run_record.ConfigDriftError, match=r"^training.steps = 14 runs past lr_scheduler.total_steps = 10"):
        _check(saved, _record("--training.steps", "14", "--lr_scheduler.total_steps", "10"))


def test_other_data_is_refused_the_same_data_elsewhere_is_not(tmp_path: Path) -> None:
    text = bytes(range(256)) * 400
    (tmp_path / "a.txt").write_bytes(text)
    (tmp_path / "copy.txt").write_bytes(text)
    (tmp_path / "b.txt").write_bytes(text[:-1] + b"!")  # same size, last byte differs
    saved = _record("--training.dataset_path", str(tmp_path / "a.txt"))
    assert _check(saved, _record("--training.dataset_path", str(tmp_path / "copy.txt"))) == []
    with pytest.raises(run_record.ConfigDriftError, match=r"^training.dataset_path = .*b.txt"):
        _check(saved, _record("--training.dataset_path", str(tmp_path / "b.txt")))


def test_checkpoint_without_record_warns() -> None:
    warnings = _check(None, _record())  # type: ignore[arg-type]
    assert len(warnings) == 1 and "holds no run.json (saved by an older version)" in warnings[0]


def test_other_versions_are_named_not_refused() -> None:
    current = _record()
    assert _check(current, current) == []
    saved = {**current, "versions": {**current["versions"], "python": "3.9.0", "torch": "2.11.0"}}
    warnings = _check(saved, current)
    assert len(warnings) == 1 and warnings[0].startswith("note: checkpoint ckpt/step-10 was saved by ")
    assert "torch 2.11.0 (this is " in warnings[0] and "python 3.9.0 (this is " in warnings[0]


def test_allow_config_change_names_config_keys() -> None:
    with pytest.raises(ConfigError, match="checkpoint.allow_config_change has 'optimiser.lr', which is not a config key"):
        parse_args(["--checkpoint.allow_config_change", "optimizer.lr,optimiser.lr"])


# --- checksums ---------------------------------------------------------------------------------------

@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A real DCP checkpoint of a small model, written by the CheckpointManager (checksums included)."""
    model = torch.nn.Linear(64, 64)
    manager = CheckpointManager(tmp_path, {"model": ModelState(model)}, interval=1)
    manager.run_record = {"config": {}}
    return manager.save(3)


def _flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_checksums_cover_every_file(checkpoint: Path) -> None:
    written = json.loads((checkpoint / integrity.CHECKSUMS_NAME).read_text())
    # Everything but itself and the completion marker, which are written after it.
    assert sorted(written) == sorted(p.name for p in checkpoint.iterdir()
                                     if p.name not in (integrity.CHECKSUMS_NAME, layout.MARKER_NAME))
    assert {".metadata", "run.json"} <= set(written)
    assert verify_integrity(checkpoint) is True


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "run.json"])
def test_a_flipped_bit_is_refused_naming_the_file(checkpoint: Path, name: str) -> None:
    path = checkpoint / name
    _flip_bit(path, path.stat().st_size // 2)
    with pytest.raises(CheckpointError) as refused:
        verify_integrity(checkpoint)
    assert str(refused.value) == (f"checkpoint {checkpoint} is damaged: {name} does not match the checksum written "
                                  "at save (its content changed); move it out of the folder (a resume then "
                                  "picks the newest checkpoint before it), or restore it from a copy")


def test_truncated_and_missing_files_are_refused(checkpoint: Path) -> None:
    shard = checkpoint / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=rf"__0_0.distcp has {size - 1} bytes, {size} were written"):
        verify_integrity(checkpoint)
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"__0_0.distcp is missing"):
        verify_integrity(checkpoint)


def test_checkpoint_without_checksums_is_reported(checkpoint: Path) -> None:
    (checkpoint / integrity.CHECKSUMS_NAME).unlink()
    assert verify_integrity(checkpoint) is False


def test_sum_sees_moved_blocks_and_every_single_bit(tmp_path: Path) -> None:
    """Swapping two 32 KiB blocks keeps the plain word sum; the position-weighted one changes. Control:
    the same content gives the same sum."""
    first, second = os.urandom(32768), os.urandom(32768)
    (tmp_path / "a").write_bytes(first + second)
    (tmp_path / "b").write_bytes(second + first)
    (tmp_path / "c").write_bytes(first + second)
    assert integrity.file_sum(tmp_path / "a") == integrity.file_sum(tmp_path / "c")
    assert integrity.file_sum(tmp_path / "a")[:16] == integrity.file_sum(tmp_path / "b")[:16]
    assert integrity.file_sum(tmp_path / "a") != integrity.file_sum(tmp_path / "b")
    reference = integrity.file_sum(tmp_path / "a")
    for bit in range(0, 8 * 65536, 4099):  # bits spread over both blocks, at every word position mod 8
        data = bytearray(first + second)
        data[bit // 8] ^= 1 << (bit % 8)
        (tmp_path / "d").write_bytes(bytes(data))
        assert integrity.file_sum(tmp_path / "d") != reference


# --- the run lock and the ranks that joined it ---------------------------------------------------------

def test_lock_is_not_taken_over_while_a_rank_lives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher (holder) is dead; a rank that joined it is alive: refused (after the wait for ranks whose
    launcher is gone, shortened here). Once the rank is gone: taken over."""
    monkeypatch.setattr(run_lock, "ORPHANS_EXIT_S", 0.2)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    rank = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    host = socket.gethostname()
    lock = run_lock.lock_path(tmp_path)
    lock.write_text(json.dumps({"pid": int(dead.stdout), "host": host, "started": "earlier", "token": "t"}))
    os.environ[run_lock.TOKEN_ENV] = "t"
    try:
        run_lock.join(tmp_path)  # this process joins too: its line must not spoil the holder's
    finally:
        del os.environ[run_lock.TOKEN_ENV]
    with lock.open("a") as file:
        file.write("\n" + json.dumps({"pid": rank.pid, "host": host}))
    lines = lock.read_text().splitlines()
    assert json.loads(lines[1]) == {"pid": os.getpid(), "host": host} and len(lines) == 3
    lock.write_text("\n".join([lines[0], lines[2]]))  # only the other process is a live rank now
    with pytest.raises(run_lock.RunLockError, match=rf"its ranks {rank.pid} still run"):
        run_lock.acquire(tmp_path)
    rank.communicate(b"")  # the rank exits
    taken = run_lock.acquire(tmp_path)
    assert taken.owned
    taken.release()


def _orphaned_lock(folder: Path, rank: int) -> None:
    """The lock of a launcher that is gone (SIGKILLed), with ``rank`` joined to it."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    run_lock.lock_path(folder).write_text(
        json.dumps({"pid": int(dead.stdout), "host": host, "started": "earlier", "token": "t"}) + "\n"
        + json.dumps({"pid": rank, "host": host}))


def test_a_restart_right_after_a_kill_waits_for_the_exiting_ranks(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole job SIGKILLed and started again at once: its rank is still exiting when the new run looks. The
    lock is taken once the rank has exited, within the bounded wait (here the rank ends at the wait's first
    pause). Control: without the wait, the same moment is refused ("still run")."""
    def rank_and_lock() -> subprocess.Popen:
        rank = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        _orphaned_lock(tmp_path, rank.pid)
        return rank

    rank = rank_and_lock()
    monkeypatch.setattr(run_lock, "ORPHANS_EXIT_S", 0.0)
    with pytest.raises(run_lock.RunLockError, match=rf"its ranks {rank.pid} still run"):
        run_lock.acquire(tmp_path)
    rank.communicate(b"")
    rank = rank_and_lock()
    monkeypatch.setattr(run_lock, "ORPHANS_EXIT_S", 60.0)
    monkeypatch.setattr(run_lock.time, "sleep", lambda _: rank.communicate(b""))  # the rank exits meanwhile
    taken = run_lock.acquire(tmp_path)
    assert taken.owned and rank.returncode == 0
    taken.release()


def test_an_exited_rank_not_yet_reaped_does_not_hold_the_lock(tmp_path: Path) -> None:
    """A rank that has exited but whose parent has not reaped it (a zombie) runs no more: the lock is taken at
    once. Control: the process exists (a signal reaches it) until it is reaped."""
    rank = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, rank.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped
    os.kill(rank.pid, 0)
    assert not run_lock.pid_alive(rank.pid) and run_lock.pid_alive(os.getpid())
    _orphaned_lock(tmp_path, rank.pid)
    taken = run_lock.acquire(tmp_path)
    assert taken.owned
    taken.release()
    rank.wait()


# --- format numbers ----------------------------------------------------------------------------------------

def test_a_newer_record_format_is_refused(tmp_path: Path) -> None:
    record = _record()
    run_record.write_record(tmp_path, record)
    assert run_record.read_record(tmp_path) == json.loads(json.dumps(record))  # control: this format reads
    run_record.write_record(tmp_path, {**record, "format": record["format"] + 1})
    newer, now = record["format"] + 1, record["format"]
    with pytest.raises(run_record.ConfigDriftError, match=rf"run.json has format {newer}, newer than this torchtitan_rng "
                                                          rf"reads \({now}\); resume it with the version that saved it"):
        run_record.read_record(tmp_path)


def test_a_format_1_llama_checkpoint_is_refused_for_its_qkv_layout() -> None:
    # Format 1 kept attn.qkv as all queries, keys, values: the same shapes, other heads, no error at load.
    old = {**_record(), "format": 1, "versions": {"torchtitan_rng": "0.1.2"}}
    with pytest.raises(run_record.ConfigDriftError, match=r"saved by torchtitan_rng 0.1.2, whose Llama lays out "
                                                          r"attn.qkv as all queries.*finish that run with torchtitan_rng 0.1.2"):
        _check(old, _record())
    assert _check(_record(), _record()) == []  # control: this format resumes
    flux = _record("--model.name", "flux", "--model.flavor", "debug")
    old_flux = {**flux, "format": 1, "config": dict(flux["config"])}
    del old_flux["config"]["parallelism.tensor_parallel_chunks"]  # not in a format-1 record
    assert _check(old_flux, flux) == []  # Flux kept its layout; the chunks mean nothing outside the invariant mode


def test_a_key_added_since_a_record_is_compared_with_what_the_record_ran() -> None:
    # A record without parallelism.tensor_parallel_chunks ran the invariant mode unchunked (1): 4 is another run.
    saved = _record("--parallelism.world_size_invariant", "--parallelism.tensor_parallel_chunks", "1")
    del saved["config"]["parallelism.tensor_parallel_chunks"]
    current = _record("--parallelism.world_size_invariant", "--parallelism.tensor_parallel_chunks", "4")
    with pytest.raises(run_record.ConfigDriftError, match=r"parallelism.tensor_parallel_chunks = 4 but checkpoint "
                                                          r"ckpt/step-10 was trained with 1"):
        _check(saved, current)
    unchunked = _record("--parallelism.world_size_invariant", "--parallelism.tensor_parallel_chunks", "1")
    assert _check(saved, unchunked) == []  # control: the value the record ran resumes


def test_a_newer_train_state_format_is_refused() -> None:
    saved = TrainState(torch.device("cpu"), 0, 1).state_dict()
    TrainState(torch.device("cpu"), 0, 1).load_state_dict(saved)  # control: this format loads
    state = decode_state(saved[rank_key(0)])
    newer = {**saved, rank_key(0): encode_state({**state, "format": state["format"] + 1})}
    with pytest.raises(CheckpointError, match="train state of rank 0 has format 2, newer than this torchtitan_rng"):
        TrainState(torch.device("cpu"), 0, 1).load_state_dict(newer)
