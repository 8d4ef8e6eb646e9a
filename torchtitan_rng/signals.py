"""Preemption signals: a signal only sets a flag; the trainer turns it into "checkpoint and exit 0".

A cluster ends a job with a signal (SLURM: SIGTERM at the time limit, or ``--signal=USR1@90`` ahead of
it); a person at a terminal with Ctrl-C (SIGINT). Each rank handles the signals of ``signals.checkpoint_on``: the handler records the signal and
returns, so a signal can never interrupt a checkpoint half-way (a second one during the save is only
recorded again). At every step boundary the ranks vote on whether any of them got one
(``distributed.StopVote``: a CPU all-reduce read one step later, so nobody waits); then all save at that
same step and exit 0. SIGINT is the exception to "recorded again": the first Ctrl-C stops like any
checkpoint signal and says so on stderr; from then on SIGINT has its default action, so a second Ctrl-C ends
the process at once, without a save (the complete checkpoints stay; an unfinished ``.partial`` is never
loaded).

This module imports nothing heavy: ``train.py`` installs the handlers before torch is imported, so that a
signal forwarded by torchrun during start-up does not kill a rank.

Under ``torchtitan_rng.launch.launcher`` (what ``run_train.sh`` starts), torchrun receives the signal, forwards it
to every rank and reports failure even when they all stopped cleanly; each rank therefore leaves a marker
in ``$TORCHTITAN_RNG_EXIT_DIR`` when it exits 0, and the launcher exits 0 when every local rank did.

Start-up: the launcher blocks the signals as its first statement (a blocked signal stays pending instead of
taking its default action, death) and keeps them blocked while it starts the ranks, which inherit the mask
through exec; :func:`install` unblocks them once their handler is in place, so one sent meanwhile is
delivered then, to that handler.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from torchtitan_rng.errors import ConfigError

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")  # a library's (hf, lightning, the plug-in): Ctrl-C keeps its meaning there
# The trainer's (``signals.checkpoint_on`` by default): a terminal's Ctrl-C stops a run like a cluster's signal.
TRAINER_SIGNALS = (*DEFAULT_SIGNALS, "SIGINT")
EXIT_DIR_ENV = "TORCHTITAN_RNG_EXIT_DIR"
_UNHANDLEABLE = ("SIGKILL", "SIGSTOP")

_received: list[str] = []
_handled: set[int] = set()
_found: dict[int, Any] = {}  # the handler each signal had before install() took it (SIGINT: KeyboardInterrupt)


_INTERRUPT_NOTICE = (b"SIGINT: saving a checkpoint at the next step boundary, then exiting; press Ctrl-C again to "
                     b"abort without saving\n")


def _record(signum: int, frame: FrameType | None) -> None:
    if signum == signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the second Ctrl-C aborts
        os.write(2, _INTERRUPT_NOTICE)  # not print(): a handler may run inside another write to sys.stderr
    _received.append(signal.Signals(signum).name)


def signal_numbers(names: list[str] | tuple[str, ...], where: str = "config signals.checkpoint_on") -> list[int]:
    """The signals for ``signals.checkpoint_on``; ConfigError naming a bad one (``where``: the setting that
    lists them, as the user wrote it)."""
    numbers = []
    for name in names:
        number = getattr(signal, name, None)
        if not isinstance(number, signal.Signals) or name in _UNHANDLEABLE:
            raise ConfigError(
                f"{where} has {name!r}: not a signal a run can checkpoint on; "
                "use names like SIGTERM, SIGUSR1, SIGUSR2 (SIGKILL and SIGSTOP cannot be caught)"
            )
        numbers.append(int(number))
    return numbers


def install(names: list[str] | tuple[str, ...] = DEFAULT_SIGNALS) -> None:
    """Handle exactly ``names`` from now on. A signal no longer in ``names`` gets back the handler it had
    before (SIGINT raises KeyboardInterrupt again); one that arrived while it was handled is delivered again
    to that handler (the configuration did not ask to catch it)."""
    wanted = set(signal_numbers(names))
    for signum in _handled - wanted:
        found = _found.pop(signum, None)
        signal.signal(signum, found if found is not None else signal.SIG_DFL)
        if signal.Signals(signum).name in _received:
            signal.raise_signal(signum)
    for signum in wanted - _handled:
        _found.setdefault(signum, signal.getsignal(signum))
        signal.signal(signum, _record)
    _handled.clear()
    _handled.update(wanted)
    unblock(names)  # a rank started by the launcher inherited them blocked: a pending one is recorded now


def block(names: list[str] | tuple[str, ...]) -> None:
    """Hold ``names`` pending in this thread (and in the threads and processes it starts) until unblocked."""
    signal.pthread_sigmask(signal.SIG_BLOCK, signal_numbers(names))


def unblock(names: list[str] | tuple[str, ...]) -> None:
    """Deliver ``names`` again, a pending one at once, to the handler each has now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signal_numbers(names))


def pending(names: list[str] | tuple[str, ...]) -> str | None:
    """The first of ``names`` that arrived while blocked and waits, or None."""
    waiting = signal.sigpending()
    return next((name for name in names if getattr(signal, name) in waiting), None)


class Scope:
    """What :func:`handling` leaves: ``pending``, the signal the block received and did not act on."""

    def __init__(self) -> None:
        self.pending: str | None = None

    def redeliver(self) -> None:
        """Deliver ``pending`` again, to whatever handles it now (by default it ends the process)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            signal.raise_signal(getattr(signal, pending))


@contextmanager
def handling(names: list[str] | tuple[str, ...] = DEFAULT_SIGNALS, *, redeliver: bool = True) -> Iterator[Scope]:
    """Handle ``names`` for the duration of the block only (a framework's ``train()``/``fit()``): the flags
    start clear, and the handlers found on entry are back on exit, so a later run in the same process starts
    unsignalled and a signal outside training has its usual effect. A signal the block did not act on (see
    :func:`acknowledge`) is delivered again to the restored handler when the block ends without an error
    (``redeliver=False``: left in the scope's ``pending`` for the caller to redeliver later): by default it
    ends the process, so a run never exits 0 as if finished when a stop was asked and not checkpointed.
    Main thread only (as ``signal.signal``)."""
    numbers = signal_numbers(names)
    previous: dict[int, Any] = {signum: signal.getsignal(signum) for signum in numbers}
    handled, received = set(_handled), list(_received)
    _received.clear()
    for signum in numbers:
        signal.signal(signum, _record)
    _handled.clear()
    _handled.update(numbers)
    scope = Scope()
    failed = True
    try:
        yield scope
        failed = False
    finally:
        scope.pending = _received[0] if _received and not failed else None
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        _handled.clear()
        _handled.update(handled)
        _received[:] = received
        if redeliver:
            scope.redeliver()


def acknowledge() -> None:
    """The signals received so far have been acted on (a checkpoint saved, the run stopping)."""
    _received.clear()


def ignore_checkpoint_signals(worker_id: int = 0) -> None:
    """In a dataloader worker (forked from a rank, with its handlers): ignore the signals the rank
    handles. torch's workers would otherwise die of SIGTERM, and the rank with them, before it can save.
    In a rank whose run is over: a late signal changes nothing."""
    for signum in _handled:
        signal.signal(signum, signal.SIG_IGN)


def received() -> str | None:
    """The first checkpoint signal this process got, or None."""
    return _received[0] if _received else None


STARTUP = "start-up"  # the marker's second word: the rank stopped before its first step
FINISHED = "finished"  # or: the rank saved the last step (a signal then changes nothing)


def mark_clean_exit(state: str = "") -> None:
    """Tell the launcher (when there is one) that this rank exits 0; ``state``: STARTUP (stopped by a signal
    before its first step, with nothing to save), FINISHED (the last step saved) or nothing (stopped between)."""
    exit_dir = os.environ.get(EXIT_DIR_ENV)
    if exit_dir:
        local_world = os.environ.get("LOCAL_WORLD_SIZE", "1")
        (Path(exit_dir) / f"rank_{os.environ.get('LOCAL_RANK', '0')}.ok").write_text(f"{local_world} {state}".strip())


def clean_exits(exit_dir: Path) -> tuple[int, int]:
    """(ranks that exited cleanly, local ranks expected) from the markers in ``exit_dir``."""
    markers = list(exit_dir.glob("rank_*.ok"))
    expected = max((int((marker.read_text().split() or ["0"])[0]) for marker in markers), default=0)
    return len(markers), expected


def every_rank_says(exit_dir: Path, state: str) -> bool:
    """Whether every rank that left a marker exited in ``state`` (STARTUP, FINISHED)."""
    markers = list(exit_dir.glob("rank_*.ok"))
    return bool(markers) and all(marker.read_text().split()[1:] == [state] for marker in markers)
