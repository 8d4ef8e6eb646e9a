"""Ranks die with their launcher: a launcher killed outright (SIGKILL, an OOM kill) must not leave ranks
that go on training and writing into the dump folder while a resubmitted run starts there.

The launcher puts its pid in ``TORCHTITAN_RNG_LAUNCHER_PID``; a rank started under it asks Linux for
SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``), then checks that the launcher had not already
gone before that request (the signal would never come). Elsewhere (not Linux, no launcher) nothing
changes; the run lock still refuses a second run while a rank of the first lives (run_lock.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from torchtitan_rng.launch.run_lock import pid_alive

LAUNCHER_PID_ENV = "TORCHTITAN_RNG_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_launcher() -> None:
    """Call first thing in a rank: SIGKILL when the launcher that started it dies."""
    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    if not launcher.isdigit() or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # not allowed here (a sandbox): the run lock still guards the folder
    if os.getppid() != int(launcher) and not pid_alive(int(launcher)):
        print(f"error: the launcher (pid {launcher}) that started this rank is gone; exiting", file=sys.stderr)
        os._exit(1)
