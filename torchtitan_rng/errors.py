"""The one base of every error a user sees, and how an entry point reports it.

Each error's message is one line: what is wrong and what to do. Library code words it with library parameters
(``load_step=5``, ``on_world_size_change="reseed"``); the trainer's entry points print it worded as the
trainer's flags (``--checkpoint.load_step 5``, :func:`torchtitan_rng.config.as_flags`). An entry point catches
:class:`TorchtitanRngError` and nothing narrower, prints ``error: <line>`` and exits 2, with no traceback.
This module imports nothing: every layer may raise these.
"""

from __future__ import annotations

import sys
from typing import Callable


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
    return 2
