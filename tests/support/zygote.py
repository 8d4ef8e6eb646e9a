"""A warm start for the Python processes the tests launch: a server that has imported torch and this package,
and run no torch op, forks one fresh child per command (never a reused worker: a process that trained once
keeps dynamo config, thread counts, deterministic-algorithm flags, signal handlers and registries, exactly
what this project exists to catch). A child is ``python -m MODULE ARGS`` with the caller's environment,
directory and output files, and ends as that process would (``sys.exit``, then the interpreter's own
shutdown); its exit status reaches the caller as ``subprocess.run``'s ``returncode``.

What a fork cannot change is decided when the server starts, so :func:`eligible` sends a command to the
server only when nothing read at start-up would differ: the same ``OMP_NUM_THREADS`` (torch fixes its thread
count at import), no accelerator (a driver must not be initialised before a fork), and an environment equal
to the server's but for variables read at run time (``RUN_TIME_ENV``). Everything else, and every test about
how a process is started or signalled, is started as a new interpreter. ``TORCHTITAN_RNG_ZYGOTE=0`` turns the
server off. Each child shares the server's string-hash seed; the launcher's ranks, started by torchrun, do
not.

    python -m tests.support.zygote SOCKET   # the server; it answers until its standard input closes
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
# What every launch imports, loaded once: torch and its compiler and distributed stacks, the trainer and the
# launcher (torchrun), the tools.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.run", "torchtitan_rng.trainer",
           "torchtitan_rng.launch.launcher", "torchtitan_rng.compare_losses", "torchtitan_rng.verify_resume")
# Variables the package and its storage back-ends read when a run uses them, not at import.
RUN_TIME_ENV = ("TORCHTITAN_RNG_FAULT", "TORCHTITAN_RNG_FAULT_DIR", "TORCHTITAN_RNG_RUN_LOCK", "AWS_",
                "PYTHONPATH", "PYTHONFAULTHANDLER", "PYTEST_CURRENT_TEST")
_HEADER = struct.Struct("!I")


# ---- the server ---------------------------------------------------------------------------------------------

def _serve(path: str) -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    # SIGCHLD wakes the select below through this pipe: a child's end is an event, not a poll.
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection of the caller waiting for it
    gc.freeze()  # the preloaded heap: children neither scan it nor copy its pages by touching it
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([listener, wake_read, sys.stdin], [], [])
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 4096):
            for pid in waiting:  # the test session is gone: so are its runs
                os.kill(pid, signal.SIGKILL)
            return
        if wake_read in readable:
            os.read(wake_read, 4096)
            _reap(waiting)
        if listener in readable:
            conn, _ = listener.accept()
            request, fds = _receive(conn)
            pid = os.fork()
            if pid == 0:
                for fd in (wake_read, wake_write, listener.fileno(), conn.fileno()):
                    os.close(fd)
                _become(request, fds)  # never returns: the child exits as `python -m` would
            for fd in fds:
                os.close(fd)
            conn.sendall(f"pid {pid}\n".encode())
            waiting[pid] = conn
            _reap(waiting)  # a child may have ended before it was registered


def _reap(waiting: dict[int, socket.socket]) -> None:
    while waiting:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass  # the caller gave up waiting (a timeout): nothing to tell
            conn.close()


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    size = _HEADER.unpack_from(data)[0]
    while len(data) < _HEADER.size + size:
        data += conn.recv(1 << 16)
    return json.loads(data[_HEADER.size:]), fds


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: take the caller's files, environment, directory and arguments, and run."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    env: dict[str, str] = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    # As `python -m` lays out sys.path: the working directory, then PYTHONPATH, then the installation's.
    started = [os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    sys.path[:] = [*started, *(entry for entry in sys.path[1:] if entry not in started)]
    if env.get("PYTHONFAULTHANDLER"):
        import faulthandler
        faulthandler.enable()
    sys.argv = ["-m", *request["args"]]
    # `python -m` runs the module as __main__ itself, which lives until the interpreter shuts down.
    sys.modules["__main__"] = types.ModuleType("__main__")
    runpy._run_module_as_main(request["module"])  # what `python -m` calls; SystemExit goes on up
    sys.exit(0)


# ---- the caller's side --------------------------------------------------------------------------------------

class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.folder = tempfile.mkdtemp(prefix="torchtitan_rng_zygote_")
        self.path = os.path.join(self.folder, "socket")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.zygote", self.path], cwd=REPO,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the test zygote did not start (exit {self.proc.wait()})")


_servers: dict[str, _Server] = {}
_lock = threading.Lock()


def _server(env: dict[str, str]) -> _Server:
    """This test process's server for ``env``'s thread count, started on first use."""
    threads = env.get("OMP_NUM_THREADS", "")
    with _lock:
        if threads not in _servers:
            _servers[threads] = _Server({key: value for key, value in env.items() if not _run_time(key)})
        return _servers[threads]


def _run_time(key: str) -> bool:
    return key.startswith(RUN_TIME_ENV)


def _accelerator() -> bool:
    import torch
    return torch.accelerator.is_available()


def eligible(command: list[str], env: dict[str, str]) -> bool:
    """Whether the server can start ``command`` exactly as a new interpreter would."""
    if os.environ.get("TORCHTITAN_RNG_ZYGOTE", "1") == "0" or sys.platform != "linux":
        return False
    if len(command) < 3 or command[0] != sys.executable or command[1] != "-m" or _accelerator():
        return False
    with _lock:
        server = _servers.get(env.get("OMP_NUM_THREADS", ""))
    base = server.env if server is not None else None
    fixed = {key: value for key, value in env.items() if not _run_time(key)}
    return base is None or fixed == base


def run(command: list[str], *, env: dict[str, str], cwd: str | Path,
        timeout: float | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, ...)`` through the server (see eligible)."""
    server = _server(env)
    request = json.dumps({"module": command[2], "args": command[3:], "env": env, "cwd": str(cwd)}).encode()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull) as null, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(server.path)
        message = _HEADER.pack(len(request)) + request
        socket.send_fds(conn, [message[:4096]], [null.fileno(), out.fileno(), err.fileno()])
        conn.sendall(message[4096:])
        replies = conn.makefile("r")
        pid = int(replies.readline().split()[1])
        conn.settimeout(timeout)
        try:
            line = replies.readline()
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(command, timeout) from None
        if not line.startswith("exit "):
            raise RuntimeError(f"the test zygote stopped while running {' '.join(command)}")
        outputs = []
        for file in (out, err):
            file.seek(0)
            outputs.append(file.read().decode(errors="replace"))
    return subprocess.CompletedProcess(command, int(line.split()[1]), *outputs)


if __name__ == "__main__":
    _serve(sys.argv[1])
