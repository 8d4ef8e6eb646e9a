"""Down to the module (``compare_losses A B --locate``): where two runs part inside a step's computation (the
batches and the weights entering the step equal, a module's output, a loss or a gradient not), replay that step
of each run with every module call fingerprinted, and name, per rank, the first call whose inputs are equal and
whose output differs.

Each run is replayed as ``python -m torchtitan_rng.replay`` replays it (replay.py: from its newest checkpoint
before the step, or from its start where it has none; on the process count that trained it; a custom module its
record names imported only when the user names it), with ``debug.tensor_fingerprint`` and
``debug.fingerprint_modules_at_step`` on, which change no bit of the step. The two replays are then compared as
two runs (locator.py): a module is named only where the replays part first at that step, in a module call.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Iterator

from torchtitan_rng.diagnosis.locator import Finding, locate, module_origins, read_prints
from torchtitan_rng.errors import ConfigError, TorchtitanRngError
from torchtitan_rng.replay import ReplayFailed, plan_replay, replay_into, verdict
from torchtitan_rng.samples import run_checkpoints


def _named(label: str, run: Path) -> str:
    """``A (path)``, or ``A`` where the path is that name."""
    return label if str(run) == label else f"{label} ({run})"


def locate_module(run_a: Path, run_b: Path, finding: Finding, trusted_module: str = "") -> Iterator[str]:
    """The lines of ``--locate`` for the runs' first difference ``finding`` (one inside a step's computation), as
    they come: each replay's start and whether it reproduced its run's loss, then the module calls that part
    first, per rank (or, where the replays part otherwise, the first tensor that differs between them).
    ConfigError, naming the run and what to pass, where a run's start cannot be rebuilt (before any line)."""
    step = finding.step
    observe = {"debug.tensor_fingerprint": True, "debug.fingerprint_modules_at_step": step}
    runs = {"A": run_a, "B": run_b}
    plans = {}
    for label, run in runs.items():  # both checked before either is launched
        if not run_checkpoints(run):
            raise ConfigError(f"--locate cannot rebuild {_named(label, run)}: its dump folder holds no complete "
                              "checkpoint, whose run.json records the config to replay from; train it with "
                              "--checkpoint.enable, its checkpoints in the dump folder (--locate looks nowhere else)")
        try:
            plans[label] = plan_replay(run, step, trusted_module=trusted_module, observe=observe)
        except TorchtitanRngError as err:
            raise ConfigError(f"--locate cannot rebuild {_named(label, run)}: {err}") from None
    yield f"--locate: replaying step {step} of A and B with module hooks"
    with tempfile.TemporaryDirectory(prefix="locate-") as scratch:
        dumps = []
        for label, plan in plans.items():
            dump = Path(scratch) / label
            try:
                done = replay_into(plan, dump)
            except TorchtitanRngError as err:  # the run's own start (its initial_load_path) not at hand
                raise ConfigError(f"--locate cannot rebuild {_named(label, runs[label])}: {err}") from None
            except ReplayFailed as err:
                raise TorchtitanRngError(f"--locate: the replay of {_named(label, runs[label])} failed (exit "
                                         f"{err.code}); its processes' output is above") from None
            _, reproduced = verdict(step, done.replayed, plan.logged)
            yield f"replayed {label} on {plan.processes} process(es) from {done.start}: {reproduced}"
            dumps.append(dump)
        replay_a, replay_b = read_prints(dumps[0]), read_prints(dumps[1])
    assert replay_a is not None and replay_b is not None, "a replay wrote no tensor fingerprints"
    parted = locate(replay_a, replay_b)
    if parted is None:
        yield (f"step {step}: the replays of A and B are equal in every tensor fingerprint: the difference did not "
               "recur when replayed")
        return
    in_the_step = parted.step == step and parted.in_computation
    origins = module_origins(replay_a, replay_b, step) if in_the_step else []
    yield from origins or ["in the replays, the first tensor that differs: " + parted.lines[0]]
