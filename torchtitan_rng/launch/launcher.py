"""torchrun for ``run_train.sh``: preflight, the dump-folder lock, and exit 0 after a preemption stop.

    python -m torchtitan_rng.launch.launcher [torchrun options] train.py --job.config_file F [overrides]

It runs torchrun in this process (this process *is* the torchrun parent) with four additions:

* Bad input (config, the checkpoint to resume from, a process count that does not fit it or the node's
  accelerators) fails here, in one line with exit 2, before any rank is started.
* On one node it takes the dump folder's lock (run_lock.py) for the whole run and hands its token to the
  ranks; with several nodes rank 0 takes it instead.
* A checkpoint signal (``signals.checkpoint_on``) at any moment of start-up stops the run with nothing to
  save and exit 0. Its first statement, before torch is imported, blocks the signals: one that comes during
  the imports, the preflight or the lock waits, and the run stops there, starting no rank. They stay
  blocked while torchrun starts the ranks, which inherit the mask; each rank unblocks them once its handlers
  are in place (signals.py) and stops before its first step. With several nodes, a signal during torchrun's
  rendezvous waits until the ranks start.
* torchrun forwards a signal it handles to every rank, waits for them, then reports failure even when all
  of them checkpointed and exited 0. The signals of ``signals.checkpoint_on`` are added to the ones
  torchrun forwards, and when such a signal ends the run, the launcher exits 0 if every local rank left
  its clean-exit marker (signals.py), else 128 + the signal number. Ranks get ``--shutdown-timeout``
  (default 30 s, or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) to save before torchrun kills them.

Only light modules are imported at the top: ``main`` blocks the signals before the rest (torch) is imported.
"""

from __future__ import annotations

import signal
import sys
from typing import TYPE_CHECKING, Any, Callable

from torchtitan_rng import signals
from torchtitan_rng.errors import EXIT_CODE
from torchtitan_rng.fault_points import hold_at

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from torchtitan_rng.config import JobConfig


def _world_size(nnodes: str, nproc_per_node: str) -> int | None:
    """The process count when it is fixed (not an elastic range, not ``auto``)."""
    return int(nnodes) * int(nproc_per_node) if nnodes.isdigit() and nproc_per_node.isdigit() else None


def _failed(failures: dict[int, ProcessFailure]) -> int:
    """The exit code of a run whose ranks failed, the same whichever rank failed first: 2 when a rank
    reported its error (its one line; all ranks report a failed save), else the lowest failed rank's."""
    reported = sorted(rank for rank, failure in failures.items() if failure.exitcode == EXIT_CODE)
    if reported:
        if 0 not in failures:  # rank 0's output is the one shown, and it did not fail
            print(f"error: rank {reported[0]} failed; its one-line message is in its own output",
                  file=sys.stderr, flush=True)
        return EXIT_CODE
    rank, failure = min(failures.items())
    code = failure.exitcode
    reason = f"exit code {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
    print(f"error: rank {rank} failed ({reason}); its message is above", file=sys.stderr, flush=True)
    return code if code > 0 else 1


def _starting_ranks_blocked(names: list[str], started: list[int]) -> None:
    """Make torchrun start its ranks with ``names`` blocked (they inherit the mask through exec and unblock
    them once their handlers are in place), then unblock them here: a signal that waited is delivered now,
    to torchrun's handler, which forwards it to the ranks. ``started`` gets each start's rank count."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    start_workers: Callable[..., Any] = LocalElasticAgent._start_workers

    def blocked_start(agent: LocalElasticAgent, worker_group: Any) -> Any:
        signals.block(names)  # again for a restart (--max-restarts): this thread unblocked them after the first
        try:
            pids = start_workers(agent, worker_group)
            started.append(len(pids))
            hold_at("launcher_ranks_started")
        finally:
            signals.unblock(names)
        return pids

    # torchrun builds its agent inside run(); its start is the one moment both the ranks and the handler exist.
    LocalElasticAgent._start_workers = blocked_start  # type: ignore[method-assign]


def _stopped_before_training(name: str, config: JobConfig) -> int:
    from torchtitan_rng.launch import preflight

    print(f"{name}: stopped before training started, nothing new to save; {preflight.how_to_resume(config.checkpoint)}",
          flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    # First: until torchrun's handlers and the ranks' own are in place, a checkpoint signal waits instead of
    # killing this process (its default action: exit 138 or 143, an empty log; Ctrl-C's, a KeyboardInterrupt
    # raised in whatever is importing).
    signals.block(signals.TRAINER_SIGNALS)
    hold_at("launcher_start")
    return _launch(sys.argv[1:] if argv is None else argv)


def _launch(argv: list[str]) -> int:
    import logging
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from torchtitan_rng import device, resume
    from torchtitan_rng.checkpoint import integrity
    from torchtitan_rng.config import as_flags, parse_args
    from torchtitan_rng.errors import ConfigError, TorchtitanRngError, report
    from torchtitan_rng.launch import orphans, preflight, run_lock

    args = torchrun.parse_args(argv)
    single_node = args.nnodes == "1"
    lock = None
    try:
        config = parse_args(args.training_script_args)
        checkpoint_on = list(config.signals.checkpoint_on)
        signals.block(checkpoint_on)  # the config's own too (bad names: one line here)
        # A default one the config does not list gets its default action back (a pending one, now).
        signals.unblock([name for name in signals.TRAINER_SIGNALS if name not in checkpoint_on])
        if str(args.nproc_per_node).isdigit():
            problem = device.too_many_processes(int(args.nproc_per_node))
            if problem is not None:
                raise ConfigError(problem)
        hold_at("launcher_preflight")
        resumed = preflight.check(config, _world_size(args.nnodes, str(args.nproc_per_node)))
        hold_at("launcher_checked")
        lock = run_lock.acquire(config.job.dump_folder) if single_node else None
        if lock is not None:  # after the lock: a run in progress is named as such, not as a history
            preflight.refuse_restart_over_history(config)
            for line in resume.claim_folder(config):  # before any save, refused for another run's folder
                print(line, flush=True)
        hold_at("launcher_locked")
    except TorchtitanRngError as err:
        if lock is not None:
            lock.release()
        return report(err, as_flags)
    waiting = signals.pending(checkpoint_on)
    if waiting is not None:  # it came during the imports, the preflight or the lock: no rank to start
        if lock is not None:
            lock.release()
        return _stopped_before_training(waiting, config)
    # torchrun's own lines on a rank's exit ("failed (exitcode: 2)", "closing signal SIGTERM"): the ranks'
    # messages and this launcher's one line say it.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    forwarded = [name.strip() for name in args.signals_to_handle.split(",") if name.strip()]
    args.signals_to_handle = ",".join(dict.fromkeys([*forwarded, *checkpoint_on]))
    started: list[int] = []
    _starting_ranks_blocked(checkpoint_on, started)
    exit_dir = Path(tempfile.mkdtemp(prefix="torchtitan_rng_exits_"))
    os.environ[signals.EXIT_DIR_ENV] = str(exit_dir)
    os.environ[orphans.LAUNCHER_PID_ENV] = str(os.getpid())  # the ranks die with this process
    if resumed is not None:  # its files were just verified: rank 0 need not read them all again
        os.environ[integrity.VERIFIED_ENV] = str(resumed)
    if lock is not None:
        os.environ[run_lock.TOKEN_ENV] = lock.token
    try:
        torchrun.run(args)
        return 0
    except SignalException as err:
        for name in args.signals_to_handle.split(","):  # the ranks are gone; a late signal changes nothing
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        if not started:  # it came before torchrun started any rank
            return _stopped_before_training(err.sigval.name, config)
        clean, expected = signals.clean_exits(exit_dir)
        if expected and clean == expected:
            if signals.every_rank_says(exit_dir, signals.STARTUP):
                return _stopped_before_training(err.sigval.name, config)
            if signals.every_rank_says(exit_dir, signals.FINISHED):  # too late to stop before the last step
                print(f"{err.sigval.name}: all {clean} local ranks saved the last step and exited 0; training is "
                      "finished", flush=True)
                return 0
            print(f"{err.sigval.name}: all {clean} local ranks checkpointed and exited 0; "
                  f"{preflight.how_to_resume(config.checkpoint)}", flush=True)
            return 0
        print(f"error: stopped by {err.sigval.name} before every rank had checkpointed ({clean} local ranks "
              f"exited cleanly); to resume from the newest complete checkpoint, "
              f"{preflight.how_to_resume(config.checkpoint).removesuffix(' to resume')}", file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        return _failed(err.failures)
    finally:
        shutil.rmtree(exit_dir, ignore_errors=True)
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    sys.exit(main())
