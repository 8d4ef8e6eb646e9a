"""Check that your own config resumes exactly, before trusting a cluster with it.

    python -m torchtitan_rng.verify_resume --config F --steps N --stop-at K [--nproc P] [--keep DIR]
                                           [--section.key value ...]

Runs, in a temporary folder, A: N steps uninterrupted, and B: the same stopped at step K (its checkpoint
written there) and resumed to N, both with the learning-rate horizon pinned and RNG and tensor fingerprints on.
Prints PASS or FAIL with the diagnosis (the first differing step, which random stream on which rank differed
first, and which tensor) and exits 0 (PASS), 1 (FAIL) or 2 (bad input, or a run refused its configuration).

--nproc P runs each leg with P processes (torchrun); --keep DIR keeps both runs in DIR (new or empty).
Every other option is a config override given to all runs; relative paths mean the current directory.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from torchtitan_rng.compare_losses import compare_records
from torchtitan_rng.config import ConfigError, lr_total_steps, parse_args
from torchtitan_rng.diagnosis.divergence import describe, diagnose, first_stream_divergence
from torchtitan_rng.diagnosis.locator import Draws, TensorPrints
from torchtitan_rng.launch.runs import run_training
from torchtitan_rng import errors
from torchtitan_rng.errors import TorchtitanRngError
from torchtitan_rng.loss_log import loss_log_path, read_loss_log

USAGE = ("usage: python -m torchtitan_rng.verify_resume --config F --steps N --stop-at K [--nproc P] "
         "[--keep DIR] [--section.key value ...]")
_OWN_OPTIONS = ("--config", "--steps", "--stop-at", "--nproc", "--keep")


@dataclass
class Request:
    config: Path
    steps: int
    stop_at: int
    nproc: int = 1
    keep: Path | None = None
    overrides: list[str] = field(default_factory=list)


class RunFailed(RuntimeError):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _int(name: str, raw: str, minimum: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def parse_request(argv: list[str]) -> Request:
    """Our own options; everything else is passed to both runs as config overrides."""
    own: dict[str, str] = {}
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        name, has_value, value = argv[i].partition("=")
        if name not in _OWN_OPTIONS:
            overrides.append(argv[i])
            i += 1
            continue
        if not has_value:
            if i + 1 >= len(argv):
                raise ConfigError(f"{name} needs a value")
            value = argv[i + 1]
            i += 1
        own[name] = value
        i += 1
    missing = [name for name in ("--config", "--steps", "--stop-at") if name not in own]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)}; {USAGE}")
    request = Request(
        # Absolute for the report; the runs start in this directory, so relative overrides mean it too.
        config=Path(own["--config"]).resolve(),
        steps=_int("--steps", own["--steps"], 2),
        stop_at=_int("--stop-at", own["--stop-at"], 1),
        nproc=_int("--nproc", own.get("--nproc", "1"), 1),
        keep=Path(own["--keep"]).resolve() if "--keep" in own else None,
        overrides=overrides,
    )
    if request.stop_at >= request.steps:
        raise ConfigError(f"--stop-at {request.stop_at} must be below --steps {request.steps}")
    if request.keep is not None and request.keep.exists() and any(request.keep.iterdir()):
        raise ConfigError(f"--keep {request.keep} is not empty; give a new or empty folder (nothing is overwritten)")
    return request


def _common_overrides(request: Request) -> list[str]:
    # Parsed here first so that a bad override is one line now, not three failed runs later.
    config = parse_args(["--job.config_file", str(request.config), *request.overrides,
                         "--training.steps", str(request.steps)])
    return [
        *request.overrides,
        "--lr_scheduler.total_steps", str(lr_total_steps(config)),
        # The optimizer state at every step: A saves no checkpoint where B stops, and what B's resume loaded is
        # compared with A's state there.
        "--debug.rng_fingerprint", "--debug.tensor_fingerprint", "--debug.fingerprint_optimizer_every_step",
        # Both runs start from scratch, whatever the config says about loading.
        "--checkpoint.initial_load_path=", "--checkpoint.load_step", "-1",
    ]


def _run(request: Request, label: str, dump: Path, args: list[str]) -> None:
    started = time.perf_counter()
    # The dump folder last, so that no override can point a run at the user's own folder.
    proc = run_training(request.config, [*args, "--job.dump_folder", str(dump)], nproc=request.nproc)
    if proc.returncode == 2:  # the trainer refused the configuration: its own one-line error is the answer
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        raise RunFailed(errors[-1][len("error: "):] if errors else f"run {label} exited with code 2", 2)
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr).strip().splitlines()
        tail = "\n".join("    " + line for line in output[-15:])
        raise RunFailed(f"run {label} exited with code {proc.returncode}:\n{tail}", 1)
    print(f"  run {label}: done in {time.perf_counter() - started:.1f}s", flush=True)


def verify(request: Request, work: Path) -> tuple[bool, list[str]]:
    """Run A and B under ``work``; (passed, report lines)."""
    common = _common_overrides(request)
    steps, stop_at = str(request.steps), str(request.stop_at)
    print(f"verify_resume: {request.config}, {request.steps} steps, stop at {request.stop_at}, "
          f"{request.nproc} process(es), in {work}", flush=True)
    run_a, run_b = work / "A", work / "B"
    _run(request, f"A ({steps} steps, uninterrupted)", run_a, [*common, "--training.steps", steps])
    _run(request, f"B ({stop_at} steps, then stopped)", run_b, [*common, "--checkpoint.enable", "--training.steps", stop_at])
    _run(request, f"B (resumed to {steps})", run_b, [*common, "--checkpoint.enable", "--training.steps", steps])

    a, b = read_loss_log(run_a), read_loss_log(run_b)
    lines_b = len(loss_log_path(run_b).read_text().splitlines())
    if lines_b != request.steps:
        return False, [f"run B did not resume from step {request.stop_at}: its log has {lines_b} lines for "
                       f"{request.steps} steps (does the config exclude train_state from loading?)"]
    result = compare_records(a, b)
    prints = TensorPrints(run_a, run_b)
    if not result.equal:
        if not result.loss_differs:
            return False, [result.message]
        divergence = first_stream_divergence(a, b, up_to=result.first_step)
        draws = Draws(divergence.step, divergence.drawing()) if divergence is not None else None
        return False, [result.message, *diagnose(a, b, result.first_step, prints.launches(result.first_step)),
                       *prints.report(result.first_step, draws)[1]]
    # Equal losses but a differing stream: a config that used that stream would not resume exactly.
    divergence = first_stream_divergence(a, b)
    if divergence is not None:
        lines = describe(divergence, a, b, prints.launches(divergence.step))
        return False, ["the losses are equal, but " + lines[0], *lines[1:]]
    state, lines = prints.report()
    if state == "found":  # equal losses, but a parameter or the optimizer state is not what it was
        return False, ["the losses are equal, but " + lines[0], *lines[1:]]
    return True, [result.message + ", and every random stream and tensor fingerprint equal on every rank at every "
                  "step"]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        print(__doc__.strip())
        return 0
    try:
        missing = errors.torch_missing("verify_resume")
        if missing is not None:
            raise missing
        request = parse_request(args)
        with tempfile.TemporaryDirectory(prefix="verify_resume_") as scratch:
            work = request.keep if request.keep is not None else Path(scratch)
            passed, report = verify(request, work)
    except TorchtitanRngError as err:
        return errors.report(err)
    except RunFailed as err:
        if err.exit_code == 2:
            print(f"error: {err}", file=sys.stderr)
        else:
            print(f"FAIL: {err}")
        return err.exit_code
    print(("PASS: " if passed else "FAIL: ") + report[0])
    for line in report[1:]:
        print(line)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
