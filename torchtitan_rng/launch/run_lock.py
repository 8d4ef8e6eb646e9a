"""One run per dump folder: ``{dump_folder}/.run.lock`` names the run that holds it.

Two runs writing the same checkpoints and loss log would corrupt each other's resume, so the second one
refuses, naming the first. The lock is a file created with O_EXCL whose first line is JSON (pid, host,
start time, command, a random token); its holder refreshes its modification time every ``HEARTBEAT_S``
seconds.

A lock is stale, and taken over, when its process is gone (same host: the pid no longer exists) or its
heartbeat stopped more than ``STALE_AFTER_S`` seconds ago (any host: a job killed on another node).

Who takes it: the launcher (``run_train.sh``, one node) before torchrun starts, passing its token to the
ranks in ``TORCHTITAN_RNG_RUN_LOCK``; a rank whose environment carries the lock's token runs under it.
Otherwise (``python train.py``, plain torchrun, several nodes) rank 0 takes it for the run.

Ranks under the launcher's lock append a line with their pid to it (``join``): a launcher killed
outright leaves ranks that may still write, and the lock is not stale while one of them lives. (They
also die with the launcher: launch/orphans.py.)
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from torchtitan_rng.errors import TorchtitanRngError, disk_full

LOCK_NAME = ".run.lock"
TOKEN_ENV = "TORCHTITAN_RNG_RUN_LOCK"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 120.0
# How long ranks whose launcher is gone may take to exit before a new run is refused: they were SIGKILLed with it
# (orphans.py) and are exiting, which freeing a large process's memory can take seconds.
ORPHANS_EXIT_S = 30.0
_POLL_S = 0.05


class RunLockError(TorchtitanRngError, RuntimeError):
    """The dump folder is in use; the message names the run holding it."""


def lock_path(dump_folder: str | Path) -> Path:
    return Path(dump_folder) / LOCK_NAME


def _records(path: Path) -> list[dict[str, Any]]:
    """The lock's lines: the holder first, then one per rank that joined (an unreadable line is skipped)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        records.append(record if isinstance(record, dict) else {})
    return records


def _read(path: Path) -> dict[str, Any] | None:
    records = _records(path)
    return records[0] or None if records else None


def _live_ranks(path: Path) -> list[int]:
    """Pids of this host's ranks that joined the lock and are still alive."""
    host = socket.gethostname()
    return [int(rank["pid"]) for rank in _records(path)[1:]
            if rank.get("host") == host and isinstance(rank.get("pid"), int) and pid_alive(rank["pid"])]


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and has not exited (a zombie, not yet reaped by its parent, has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone meanwhile; or no /proc (not Linux): the signal's answer stands
        return not os.path.isdir("/proc/self")
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"  # the state, after the command's "(name)"


def _wait_for_orphans(path: Path, holder: dict[str, Any] | None) -> None:
    """When the lock's launcher is gone from this host, wait up to ``ORPHANS_EXIT_S`` for its ranks to exit: a
    restart the instant after a SIGKILL of the whole job finds them still exiting, condemned with it."""
    if holder is None or holder.get("host") != socket.gethostname() or pid_alive(int(holder.get("pid", -1))):
        return
    deadline = time.monotonic() + ORPHANS_EXIT_S
    while _live_ranks(path) and time.monotonic() < deadline:
        time.sleep(_POLL_S)


def _is_stale(path: Path, holder: dict[str, Any] | None) -> bool:
    if _live_ranks(path):  # whatever became of the launcher, its ranks still run
        return False
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return True
    if age > STALE_AFTER_S:
        return True
    if holder is None:  # being written right now by its creator, or garbage that will age out
        return False
    return holder.get("host") == socket.gethostname() and not pid_alive(int(holder.get("pid", -1)))


def describe(holder: dict[str, Any] | None, live_ranks: Sequence[int] = ()) -> str:
    if holder is None:
        return "a run whose lock file cannot be read yet"
    ranks = f"; its ranks {', '.join(map(str, live_ranks))} still run" if live_ranks else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}{ranks}"


def join(dump_folder: str | Path) -> None:
    """In a rank under the launcher's lock: add this process to it (a no-op outside the launcher)."""
    token = os.environ.get(TOKEN_ENV)
    path = lock_path(dump_folder)
    if not token or (_read(path) or {}).get("token") != token:
        return
    with path.open("a") as file:  # one short O_APPEND write: ranks joining at once do not mix lines
        file.write("\n" + json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))


class RunLock:
    """A held lock (or, with ``owned=False``, the launcher's lock this process runs under)."""

    def __init__(self, path: Path, token: str, owned: bool) -> None:
        self.path = path
        self.token = token
        self.owned = owned
        self._stop = threading.Event()
        if owned:
            threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True).start()
            atexit.register(self.release)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        """Remove the lock file if it is still ours (idempotent)."""
        self._stop.set()
        if self.owned and (_read(self.path) or {}).get("token") == self.token:
            self.path.unlink(missing_ok=True)
        self.owned = False


def acquire(dump_folder: str | Path) -> RunLock:
    """Take the dump folder's lock, take over a stale one, or raise RunLockError naming the holder."""
    path = lock_path(dump_folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    inherited = os.environ.get(TOKEN_ENV)
    token = uuid.uuid4().hex
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "token": token,
    }
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(path)
            if inherited and holder is not None and holder.get("token") == inherited:
                return RunLock(path, inherited, owned=False)
            _wait_for_orphans(path, holder)
            if not _is_stale(path, holder):
                raise RunLockError(
                    f"dump folder {path.parent} is in use by another run ({describe(holder, _live_ranks(path))}; lock "
                    f"file {path}); "
                    f"wait for it to finish or use another --job.dump_folder (delete the lock file only if that "
                    f"run is gone)"
                ) from None
            path.unlink(missing_ok=True)  # a dead run's lock (two runs taking it over at once: not handled)
            continue
        try:
            with os.fdopen(fd, "w") as file:
                json.dump(record, file)
        except OSError as err:  # a full disk: no half-written lock may stay to refuse the next run
            path.unlink(missing_ok=True)
            problem = "the disk is full" if disk_full(err) else err.strerror
            raise RunLockError(f"could not write the run lock {path}: {problem}; free space in "
                               f"{path.parent} (or pass another --job.dump_folder), then run again") from None
        return RunLock(path, token, owned=True)
    raise RunLockError(f"could not take the lock {path}: other runs keep taking it; try again")
