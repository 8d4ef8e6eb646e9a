"""The one base of every error a user sees, and how an entry point reports it.

Each error's message is one line: what is wrong and what to do. Library code words it with library parameters
(``load_step=5``, ``on_world_size_change="reseed"``); the trainer's entry points print it worded as the
trainer's flags (``--checkpoint.load_step 5``, :func:`torchtitan_rng.config.as_flags`). An entry point catches
:class:`TorchtitanRngError` and nothing narrower, prints ``error: <line>`` and exits 2, with no traceback.
This module imports nothing: every layer may raise these.
"""

from __future__ import annotations

import errno
import sys
from typing import Callable


EXIT_CODE = 2  # of every error reported in one line, by any process of a run


class TorchtitanRngError(Exception):
    """Bad input or an unusable checkpoint, log or folder; ``str(err)`` is the line to show."""


class ConfigError(TorchtitanRngError, ValueError):
    """A bad configuration: the message names the key, what is wrong with it and what to do."""


class CheckpointError(TorchtitanRngError, RuntimeError):
    """A checkpoint cannot be used (or not exactly); the message says which and why."""


def report(err: TorchtitanRngError, wording: Callable[[str], str] = str) -> int:
    """Print ``err`` as one ``error:`` line on stderr (``wording`` turns library wording into the caller's) and
    return the exit code for bad input."""
    print(f"error: {wording(str(err))}", file=sys.stderr, flush=True)
    return EXIT_CODE


def torch_missing(command: str) -> TorchtitanRngError | None:
    """The error of a command that needs torch run by a Python that cannot import it (None: it can), found
    without importing torch: the command reports it in one line instead of failing with a traceback, or, where
    it launches runs, instead of judging runs that could not start."""
    from importlib.util import find_spec

    if find_spec("torch") is not None:
        return None
    return TorchtitanRngError(f"{sys.executable} cannot import torch, which python -m torchtitan_rng.{command} "
                              "needs; run it with the Python that trains (the one run_train.sh uses), or install "
                              "torch into this one")


def exit_without_torch(command: str) -> None:
    """Exit (2) with :func:`torch_missing`'s line when torch cannot be imported: an entry module calls it when run
    (``__main__``), before the imports that need torch."""
    missing = torch_missing(command)
    if missing is not None:
        sys.exit(report(missing))


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters), else its type's name."""
    lines = str(err).strip().splitlines()
    return lines[0][:300] if lines else type(err).__name__


# No space left, a quota, a file-size limit: to the user, all "the disk is full".
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def disk_full(err: BaseException) -> OSError | None:
    """The OSError of a write that failed for lack of space, in ``err`` or the exceptions it was raised from
    (torch's serialization reports a short write as "unexpected pos", with the OSError as its context)."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _DISK_FULL:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
