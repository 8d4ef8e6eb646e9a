"""The light half of fault injection (fault_injection.py): parsing ``TORCHTITAN_RNG_FAULT`` and holding at a
point. It imports nothing heavy, so the launcher can hold before it imports torch and a rank before its signal
handlers are in place (the start-up window a signal may hit)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "TORCHTITAN_RNG_FAULT"
HOLD_DIR_ENV = "TORCHTITAN_RNG_FAULT_DIR"
# The launcher's points (held by the launcher process, named ``POINT-0-launcher``), then a rank's.
LAUNCHER_POINTS = ("launcher_start", "launcher_preflight", "launcher_checked", "launcher_locked",
                   "launcher_ranks_started")
POINTS = (*LAUNCHER_POINTS, "rank_start", "before_process_group", "startup", "startup_done", "data_loading",
          "compile", "before_step", "validation", "save_writing", "save_written", "save_marking", "save_renamed",
          "prune", "loss_spike")
HOLD = 0  # the action "hold" (no signal has number 0)
SIGNALLED = "signalled-"  # prefix of the file a hold leaves once its process has a checkpoint signal


@dataclass(frozen=True)
class Fault:
    point: str
    step: int
    rank: int | None
    signum: int  # or HOLD


def parse(spec: str) -> dict[tuple[str, int], list[Fault]]:
    faults: dict[tuple[str, int], list[Fault]] = {}
    for entry in filter(None, (part.strip() for part in spec.split(";"))):
        fields = entry.split(":")
        if len(fields) < 2 or fields[0] not in POINTS:
            raise ValueError(f"{ENV_VAR}: bad entry {entry!r}; expected POINT:STEP[:RANK[:SIGNAL]], POINT in {POINTS}")
        rank = None if len(fields) < 3 or fields[2] == "*" else int(fields[2])
        action = fields[3] if len(fields) > 3 else "SIGKILL"
        signum = HOLD if action == "hold" else int(getattr(signal, action))
        fault = Fault(fields[0], int(fields[1]), rank, signum)
        faults.setdefault((fault.point, fault.step), []).append(fault)
    return faults


def _has_stop_signal() -> bool:
    """Whether this process got a checkpoint signal: handled (recorded) or blocked (pending)."""
    from torchtitan_rng import signals  # light; imported here as signals imports nothing of this module

    return signals.received() is not None or signals.pending(signals.TRAINER_SIGNALS) is not None


def hold(name: str) -> None:
    """Create ``name`` in the hold folder and wait until the test deletes it. Once this process has a
    checkpoint signal, ``signalled-NAME`` appears beside it: a test that signalled another process (the
    launcher, which forwards to the ranks) knows when the signal got here."""
    folder = Path(os.environ[HOLD_DIR_ENV])
    held = folder / name
    held.touch()
    signalled = False
    while held.exists():
        if not signalled and _has_stop_signal():
            signalled = True
            (folder / f"{SIGNALLED}{name}").touch()
        time.sleep(0.01)  # polling the test's answer, not a guessed delay


def hold_at(point: str, rank: int | None = None) -> None:
    """Hold at ``point`` (step 0) where the environment arms it, in a process without a FaultInjector: the
    launcher (``rank`` None: its file is ``POINT-0-launcher``) or a rank before it has one. A rank restarted by
    torchrun holds nowhere, as with fault_injection."""
    spec = os.environ.get(ENV_VAR, "")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    for fault in parse(spec).get((point, 0), []):
        if fault.signum == HOLD and (rank is None or fault.rank in (None, rank)):
            hold(f"{point}-0-{'launcher' if rank is None else f'rank{rank}'}")
