"""A warm start for the Python processes the tests launch: a server that has imported torch and this package,
and run no torch op, forks one fresh child per command (never a reused worker: a process that trained once
keeps dynamo config, thread counts, deterministic-algorithm flags, signal handlers and registries, exactly
what this project exists to catch). A child is ``python [-u] -m MODULE ARGS`` or ``python [-u] SCRIPT.py
ARGS`` with the caller's environment, directory and output files, and ends as that process would
(``sys.exit``, then the interpreter's own shutdown); its exit status reaches the caller as
``subprocess.run``'s ``returncode``.

What a fork cannot change was decided when the server started, so the server forks only a command whose
environment agrees with its own in everything read at start-up (:func:`_startup_differs`: thread counts,
Python's and torch's start-up variables, the device choice); it answers "cold" to the rest, which then run
as new interpreters. ``TORCHTITAN_RNG_ZYGOTE=0`` turns the server off. Each forked child shares the server's
string-hash seed.

Inside a forked child ``sys.executable`` is the server's relay, a stand-in Python without torch: given
``[-u] -m MODULE ...`` or ``[-u] SCRIPT.py ...`` it has the server fork that command with the relay's environment and output files,
passes on every signal it gets and exits as the child did; given anything else it becomes the real
interpreter (``exec``). So the processes a forked command starts (torchrun's ranks, the runs of
``verify_resume`` and ``replay``, ``run_train.sh`` given ``PYTHON=relay``) are warm too. A relay dies with
its parent (torchrun's SIGKILL, a killed launcher), and the server then kills its child.

    python -m tests.support.zygote SOCKET [PRELOAD ...]   # the server; it answers until its standard input closes
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import gc
import importlib
import io
import json
import os
import random
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
# Variables whose value may differ from the server's: read when a run uses them, not at start-up (PYTHON:
# run_train.sh's choice of interpreter; PWD, OLDPWD, SHLVL and _: a shell's own).
RUN_TIME = {"PYTHON", "PYTHONPATH", "PYTHONFAULTHANDLER", "PYTHONUNBUFFERED", "PYTEST_CURRENT_TEST", "PWD",
            "OLDPWD", "SHLVL", "_"}
RUN_TIME_PREFIXES = ("TORCHTITAN_RNG_", "AWS_")
# Variables Python, its allocator, OpenMP or torch read at start-up or import: a child may not add them.
START_UP = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "MALLOC_", "LD_", "CUDA_", "TORCHINDUCTOR_",
            "TORCHDYNAMO_", "TORCH_LOGS", "TORCH_COMPILE", "TORCHTITAN_RNG_DEVICE")
_HEADER = struct.Struct("!I")
RECORD = "TORCHTITAN_RNG_LAUNCH_RECORD"  # tests/support/launch.py's record, which forked processes join
_RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _run_time(key: str) -> bool:
    """Whether a variable is read only when a run uses it (it may differ from the server's)."""
    return key in RUN_TIME or (key.startswith(RUN_TIME_PREFIXES) and not key.startswith(START_UP))


def _startup_differs(env: dict[str, str], own: dict[str, str], imported: dict[str, str]) -> bool:
    """Whether ``env`` differs from the server's start-up environment ``own`` in what start-up reads. What the
    imports add (``imported``) may be absent or equal: a child of a forked run inherits it, as a child of a
    new interpreter would (torchrun's ranks: the launcher's torch set TORCHINDUCTOR_CACHE_DIR)."""
    for key in own.keys() | env.keys():
        if env.get(key) == own.get(key) or _run_time(key) or (key in imported and env[key] == imported[key]):
            continue
        if key in own or key.startswith(START_UP):
            return True  # changed, removed, or a start-up variable added
    return False


# ---- the server ---------------------------------------------------------------------------------------------

def _serve(path: str, preload: list[str]) -> None:
    own = dict(os.environ)  # as start-up saw it
    for name in (*PRELOAD, *preload):
        if name.endswith(".py"):  # a script's module, imported as its run finds it: from the script's folder
            sys.path.insert(0, os.path.dirname(name))
            name = Path(name).stem
        importlib.import_module(name)
    # What the imports put in the environment (torch: TORCHINDUCTOR_CACHE_DIR), as they would in a new process.
    imported = {key: value for key, value in os.environ.items() if key not in own}
    sources = _sources()
    relay = _write_relay(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    # SIGCHLD wakes the select below through this pipe: a child's end is an event, not a poll.
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection of the caller waiting for it
    accounts: dict[int, dict[str, str]] = {}  # child pid -> where its CPU time is recorded (_account)
    gc.freeze()  # the preloaded heap: children neither scan it nor copy its pages by touching it
    print(relay, flush=True)
    while True:
        readable, _, _ = select.select([listener, wake_read, sys.stdin, *waiting.values()], [], [])
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 4096):
            for pid in waiting:  # the test session is gone: so are its runs
                os.kill(pid, signal.SIGKILL)
            return
        for pid, conn in list(waiting.items()):
            if conn in readable:  # its caller is gone (a timeout, a killed relay): so is the run
                os.kill(pid, signal.SIGKILL)
                waiting.pop(pid).close()
        if wake_read in readable:
            os.read(wake_read, 4096)
            _reap(waiting, accounts)
        if listener in readable:
            conn, _ = listener.accept()
            try:
                request, fds = _receive(conn)
            except (OSError, ValueError) as err:  # a caller that died mid-request: the others go on
                print(f"zygote: dropped a request ({err})", file=sys.stderr, flush=True)
                conn.close()
                continue
            if _startup_differs(request["env"], own, imported) or _sources() != sources:
                # Another start-up environment, or this checkout's code edited since the server imported it
                # (a fork would run the old modules beside the new ones): a new interpreter.
                for fd in fds:
                    os.close(fd)
                conn.sendall(b"cold\n")
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                # The server's files are not the child's. Sockets are detached first: a socket object closing
                # its number at shutdown would close whatever the run had opened under it since (gloo's).
                for sock in (listener, conn, *waiting.values()):
                    os.close(sock.detach())
                for fd in (wake_read, wake_write):
                    os.close(fd)
                _become(request, fds, relay, imported)  # never returns: the child exits as Python would
            for fd in fds:
                os.close(fd)
            conn.sendall(f"pid {pid}\n".encode())
            waiting[pid] = conn
            if RECORD in request["env"]:
                accounts[pid] = {"record": request["env"][RECORD], "program": request.get("module") or
                                 Path(request["script"]).name, "test": request["env"].get("PYTEST_CURRENT_TEST", "")}
            _reap(waiting, accounts)  # a child may have ended before it was registered


def _sources() -> dict[str, float]:
    """The modification times of this checkout's preloaded modules."""
    times = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None) or ""
        if file.startswith(str(REPO)):
            try:
                times[file] = os.stat(file).st_mtime
            except OSError:
                times[file] = -1.0
    return times


def _write_relay(path: str) -> str:
    """The stand-in Python of the forked children: this interpreter running :func:`relay`."""
    relay = os.path.join(os.path.dirname(path), "python")
    Path(relay).write_text(f"#!{sys.executable} -I\nimport sys\nsys.path.insert(0, {str(REPO)!r})\n"
                           f"from tests.support.zygote import relay\nrelay({path!r}, {sys.executable!r})\n")
    os.chmod(relay, 0o755)
    return relay


def _reap(waiting: dict[int, socket.socket], accounts: dict[int, dict[str, str]]) -> None:
    """Collect every ended child (those killed after their caller left too) and tell their callers."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:  # no child at all
            return
        if pid == 0:
            return
        if pid in accounts:
            _account(accounts.pop(pid), usage.ru_utime + usage.ru_stime)
        conn = waiting.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass  # the caller gave up waiting (a timeout): nothing to tell
            conn.close()


def _account(account: dict[str, str], cpu_s: float) -> None:
    """One line in the launch record for a forked process (each rank too): the CPU seconds it used, which load
    on the machine does not inflate as it does wall seconds."""
    line = {"test": account["test"].rsplit(" (", 1)[0], "program": account["program"], "cpu_s": round(cpu_s, 3)}
    with open(account["record"], "a", encoding="utf-8") as file:
        file.write(json.dumps(line) + "\n")


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """A request: its length with the caller's three files attached, then its JSON."""
    header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
    header += _exactly(conn, _HEADER.size - len(header))
    return json.loads(_exactly(conn, _HEADER.unpack(header)[0])), fds


def _exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the caller closed the connection mid-request")
        data += chunk
    return data


def _become(request: dict[str, Any], fds: list[int], relay: str, imported: dict[str, str]) -> None:
    """In the forked child: take the caller's files, environment, directory and arguments, and run."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # A process group of its own: a run that signals its group (os.killpg) reaches neither the server, nor
    # the test process, nor the other runs. Tests about process groups start their processes themselves.
    os.setpgid(0, 0)
    # The caller's blocked signals, as a new process inherits them (the launcher starts its ranks with the
    # checkpoint signals blocked until their handlers are in place).
    signal.pthread_sigmask(signal.SIG_SETMASK, request.get("blocked", []))
    # The caller's ignored signals stay ignored, as across an exec; the others start as a new interpreter's do
    # (SIGINT raising KeyboardInterrupt). The server's own are whatever its start left: a suite started in the
    # background starts it with SIGINT ignored.
    for signum in _RELAYED:
        if signum in request.get("ignored", []):
            signal.signal(signum, signal.SIG_IGN)
        else:
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    env: dict[str, str] = request["env"]
    os.environ.clear()
    os.environ.update({**imported, **env})
    os.chdir(request["cwd"])
    # As Python lays out sys.path: the working directory (-m) or the script's folder, then PYTHONPATH, then
    # the installation's.
    script = request.get("script")
    first = os.path.dirname(os.path.realpath(script)) if script else os.getcwd()
    started = [first, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    sys.path[:] = [*started, *(entry for entry in sys.path[1:] if entry not in started)]
    if request["unbuffered"] or env.get("PYTHONUNBUFFERED"):  # as -u: every write reaches the file at once
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    if env.get("PYTHONFAULTHANDLER"):
        import faulthandler
        faulthandler.enable()
    sys.executable = relay
    # The heap the server froze is collected at shutdown as a new process's would be (registered first, so it
    # runs after the run's own exit handlers): otherwise triton 3.9's bindings report its objects as leaks.
    atexit.register(gc.unfreeze)
    # A new interpreter seeds Python's and NumPy's global generators from the OS: a fork would share the server's.
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    # Python runs the module or script as __main__ itself, which lives until the interpreter shuts down.
    main = sys.modules["__main__"] = types.ModuleType("__main__")
    if script:
        sys.argv = [script, *request["args"]]
        main.__file__ = script
        code = compile(Path(script).read_bytes(), script, "exec")
        exec(code, main.__dict__)  # what `python script.py` does; SystemExit goes on up
    else:
        sys.argv = ["-m", *request["args"]]
        runpy._run_module_as_main(request["module"])  # what `python -m` calls
    sys.exit(0)


def _parse(argv: list[str]) -> dict[str, Any] | None:
    """``[-u] -m MODULE ARGS`` or ``[-u] SCRIPT.py ARGS`` as a request's command; None for any other."""
    unbuffered = argv[:1] == ["-u"]
    rest = argv[1:] if unbuffered else argv
    if len(rest) >= 2 and rest[0] == "-m":
        return {"module": rest[1], "args": rest[2:], "unbuffered": unbuffered}
    if rest and rest[0].endswith(".py") and os.path.isfile(rest[0]):
        return {"script": rest[0], "args": rest[1:], "unbuffered": unbuffered}
    return None


class _Reply:
    """The server's answer to one command: the child's pid, then (once it ended) its exit status. Read line by
    line from a buffered reader: a child that ends at once sends both lines in one packet."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.lines = conn.makefile("rb")
        self.pid = 0

    def line(self) -> str:
        line = self.lines.readline()
        if not line:
            raise RuntimeError("the test zygote closed the connection")
        return line.decode().strip()

    def exit_status(self) -> int:
        return int(self.line().split()[1])

    def close(self) -> None:
        self.lines.close()
        self.conn.close()


def _ignored() -> list[int]:
    """The relayed signals this process ignores: a process it started would ignore them too."""
    return [int(signum) for signum in _RELAYED if signal.getsignal(signum) == signal.SIG_IGN]


def _ask(path: str, command: dict[str, Any], fds: list[int]) -> _Reply | None:
    """Send ``command`` to the server: its reply once the child is forked, or None when it must run cold."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    data = json.dumps(command).encode()
    header = _HEADER.pack(len(data))
    sent = socket.send_fds(conn, [header], fds)
    conn.sendall(header[sent:] + data)
    reply = _Reply(conn)
    first = reply.line()
    if first == "cold":
        reply.close()
        return None
    reply.pid = int(first.split()[1])
    return reply


# ---- the relay: the forked children's `python` --------------------------------------------------------------

def relay(path: str, python: str) -> None:
    """Have the server fork the command, pass on signals, exit as it did; else become ``python``."""
    parsed = _parse(sys.argv[1:])
    if parsed is None or _inherited_files():
        os.execv(python, [python, *sys.argv[1:]])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG: die with the parent, as its child would
    child: list[int] = []
    pending: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        if child:
            os.kill(child[0], signum)
        else:
            pending.append(signum)

    blocked = [int(signum) for signum in signal.pthread_sigmask(signal.SIG_BLOCK, [])]
    ignored = _ignored()  # before the relay takes every signal
    for signum in _RELAYED:
        signal.signal(signum, forward)
    asked = _ask(path, {**parsed, "blocked": blocked, "ignored": ignored, "env": dict(os.environ),
                        "cwd": os.getcwd()}, [0, 1, 2])
    if asked is None:
        for signum in _RELAYED:
            signal.signal(signum, signal.SIG_DFL)
        os.execv(python, [python, *sys.argv[1:]])
    pid = asked.pid
    child.append(pid)
    # The child has the blocked signals now (it holds one sent to it until it unblocks them): the relay itself
    # takes every signal, to pass it on.
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for signum in pending:
        os.kill(pid, signum)
    code = asked.exit_status()
    if code < 0:  # the child died by a signal: so does its relay, for its parent to see
        for signum in _RELAYED:
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _inherited_files() -> bool:
    """Whether this relay was given open files beyond the standard three (inductor's compile workers get
    pipes by number): only those three reach a forked child, so such a command runs as a new interpreter."""
    own = {fd for fd in (0, 1, 2)}
    return any(int(fd) not in own and not _cloexec(int(fd)) for fd in os.listdir("/proc/self/fd"))


def _cloexec(fd: int) -> bool:
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC)
    except OSError:  # the listing's own descriptor, closed by now
        return True


# ---- the test process's side --------------------------------------------------------------------------------

class _Server:
    def __init__(self, env: dict[str, str], preload: tuple[str, ...]) -> None:
        self.folder = tempfile.mkdtemp(prefix="torchtitan_rng_zygote_")
        self.path = os.path.join(self.folder, "socket")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.zygote", self.path, *preload], cwd=REPO,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.relay = self.proc.stdout.readline().strip()
        if not self.relay:
            raise RuntimeError(f"the test zygote did not start (exit {self.proc.wait()})")


_servers: dict[tuple, _Server] = {}
_lock = threading.Lock()


def _server(env: dict[str, str], preload: tuple[str, ...]) -> _Server:
    """This test process's server for ``env``'s thread count, started on first use; with ``preload`` (modules
    or scripts a family of runs imports: an integration's framework), one per start-up environment, since
    what those modules read at import is fixed in the server."""
    if preload:
        key: tuple = (preload, *sorted(item for item in env.items() if not _run_time(item[0])))
    else:
        key = ((), env.get("OMP_NUM_THREADS", ""))
    with _lock:
        if key not in _servers:
            _servers[key] = _Server(env, preload)
        return _servers[key]


def enabled() -> bool:
    if os.environ.get("TORCHTITAN_RNG_ZYGOTE", "1") == "0" or sys.platform != "linux":
        return False
    import torch
    return not torch.accelerator.is_available()  # no driver may be initialised before a fork


def relay_for(env: dict[str, str], preload: tuple[str, ...] = ()) -> str | None:
    """The stand-in Python that forks the commands run with ``env`` (None: the server is off)."""
    return _server(env, preload).relay if enabled() else None


def run(command: list[str], *, env: dict[str, str], cwd: str | Path, timeout: float | None = None,
        preload: tuple[str, ...] = ()) -> subprocess.CompletedProcess | None:
    """``subprocess.run(command, capture_output=True, text=True, ...)`` forked by the server (with ``preload``
    imported too); None when the command must run as a new interpreter (neither a module nor a script, another
    start-up environment, the server off)."""
    parsed = _parse(command[1:]) if command[0] == sys.executable else None
    if parsed is None or not enabled():
        return None
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull) as null:
        asked = _ask(_server(env, preload).path, {**parsed, "env": env, "cwd": str(cwd), "ignored": _ignored()},
                     [null.fileno(), out.fileno(), err.fileno()])
        if asked is None:
            return None
        try:
            asked.conn.settimeout(timeout)
            try:
                code = asked.exit_status()
            except TimeoutError:
                os.kill(asked.pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(command, timeout) from None
        finally:
            asked.close()
        outputs = []
        for file in (out, err):
            file.seek(0)
            outputs.append(file.read().decode(errors="replace"))
    return subprocess.CompletedProcess(command, code, *outputs)


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2:])
