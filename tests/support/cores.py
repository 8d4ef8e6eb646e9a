"""One busy process per core, machine-wide: every training run a test launches holds as many cores as it has
processes (at most all of them) while it runs, whichever pytest worker, thread of ``together()`` or test
session started it. The machine stays full (a run starts as soon as its cores are free) and never overfull
(twenty ranks of one fixture no longer share two cores). A run never waits for itself: cores are taken for
one blocking launch and given back when it ends.

Each core is a lock file under the system's temporary folder; ``flock`` locks belong to the open file, so
threads of one process exclude each other as processes do, and a killed process gives its cores back.
``TORCHTITAN_RNG_TEST_CORES`` sets the count (default: the cores this process may run on).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

FOLDER = Path(tempfile.gettempdir()) / "torchtitan_rng_test_cores"


def count() -> int:
    return int(os.environ.get("TORCHTITAN_RNG_TEST_CORES") or len(os.sched_getaffinity(0)))


@contextmanager
def held(processes: int) -> Iterator[None]:
    """Hold ``min(processes, count())`` cores for the duration of the block."""
    total = count()
    wanted = max(1, min(processes, total))
    FOLDER.mkdir(exist_ok=True)
    with ExitStack() as stack:
        def opened(name: str) -> int:
            fd = os.open(FOLDER / name, os.O_RDWR | os.O_CREAT, 0o666)
            stack.callback(os.close, fd)  # closing the file releases its lock
            return fd

        # One taker at a time: a run waiting for a second core never holds the first against another that
        # could have both (the arbiter is released once this run has all of its cores).
        arbiter = opened("arbiter")
        fcntl.flock(arbiter, fcntl.LOCK_EX)
        slots = [opened(f"core_{index}") for index in range(total)]
        mine: list[int] = []
        for fd in slots:  # the free ones first
            if len(mine) < wanted and _try(fd):
                mine.append(fd)
        for fd in slots:  # then wait for busy ones, in order, until there are enough
            if len(mine) == wanted:
                break
            if fd not in mine:
                fcntl.flock(fd, fcntl.LOCK_EX)
                mine.append(fd)
        fcntl.flock(arbiter, fcntl.LOCK_UN)
        yield


def _try(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
