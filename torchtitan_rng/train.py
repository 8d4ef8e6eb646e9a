"""The trainer's entry: ``python -m torchtitan_rng.train --job.config_file F [--section.key value ...]``.

``run_train.sh`` starts it under torchrun; ``python train.py`` in a source checkout is the same. It imports
nothing heavy before the signal handlers are in place: torch takes seconds to import, and a checkpoint
signal forwarded by torchrun during that time must not kill a rank.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

from torchtitan_rng.config import Signals, parse_args, usage
from torchtitan_rng.errors import TorchtitanRngError, report
from torchtitan_rng import signals
from torchtitan_rng.fault_points import hold_at
from torchtitan_rng.launch import orphans


def main(argv: list[str] | None = None) -> int:
    orphans.die_with_launcher()
    # Under the launcher the checkpoint signals arrive blocked (signals.py): one sent before install() waits.
    hold_at("rank_start", int(os.environ.get("RANK", "0")))
    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        print(usage("python -m torchtitan_rng.train"))
        return 0
    signals.install(Signals().checkpoint_on)  # the defaults until the config is read
    try:
        config = parse_args(args)
        signals.install(config.signals.checkpoint_on)
    except TorchtitanRngError as err:
        return report(err)

    from torchtitan_rng.trainer import run

    try:
        return run(config)
    finally:
        # The run is over. Python puts caught signals back to their default action as it shuts down: a late
        # SIGTERM (torchrun closing the ranks once one of them failed) would then replace this exit code.
        signals.ignore_checkpoint_signals()


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` once the run is closed, without interpreter finalization.

    A process group can outlive ``destroy_process_group()`` when something still holds it (on the way out of a
    failure, the traceback's frames; in torch, references the trainer cannot drop): its gloo worker threads
    live on, and one that releases a collective's Python tensor after finalization began asks for the GIL,
    which ends the thread inside a C++ destructor: std::terminate, SIGABRT, and a finished run exits non-zero.
    What finalization would do that matters here is done first: non-daemon threads joined, atexit handlers
    run (the run lock's release), output flushed."""
    shutdown = getattr(threading, "_shutdown", None)  # what finalization calls first (CPython)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader is gone
            pass
    os._exit(code)


def cli() -> NoReturn:
    """The console script ``torchtitan-rng-train`` and ``python -m torchtitan_rng.train``."""
    exit_now(main())


if __name__ == "__main__":
    cli()
