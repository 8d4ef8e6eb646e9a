"""Benchmark 1: training step time with every resume feature on vs. off, in the same process (target: the
ratio on/off <= 1.01).

On (the defaults): dataloader state snapshots every checkpoint.interval steps, worker RNG capture, the
stop-signal vote at every step. Off: snapshots every 10^9 steps, no worker RNG capture, no signals. Both:
the real trainer (its progress lines give the time per step), dataloader workers, the same
``metrics.log_freq``, no checkpoint saves (benchmarks 2 and 3 time those). The runs alternate on/off, each
round swapping which goes first, so that drift in the machine's load hits both alike; the headline is the
median over rounds of each round's on/off ratio of median step times.

    python -m bench.step_time [--quick] [--workers N] [--flavor bench] [--rounds R --steps S --log-freq F]
        [TRAINER FLAGS, e.g. --compile.enable]
"""

from __future__ import annotations

import contextlib
import io
import re
import tempfile

from bench.common import DEBUG_CONFIG, median, parser, spread, table
from torchtitan_rng.train import main as train_main

FEATURES_OFF = ["--data.snapshot_every_n_steps", "1000000000", "--data.capture_worker_rng", "false",
                "--signals.checkpoint_on="]
_MS_PER_STEP = re.compile(r"\s([\d.]+) ms/step")


def run_debug_training(overrides: list[str], steps: int, log_freq: int, dump: str) -> str:
    """The debug config trained in this process; its output (the run's failure ends the benchmark)."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        code = train_main(["--job.config_file", str(DEBUG_CONFIG), "--job.dump_folder", dump,
                           "--training.steps", str(steps), "--metrics.log_freq", str(log_freq), *overrides])
    if code != 0:
        raise SystemExit(f"the training run exited {code}:\n{output.getvalue()}")
    return output.getvalue()


def step_times(overrides: list[str], steps: int, log_freq: int, dump: str) -> list[float]:
    """ms per step of each progress line but the first (which holds start-up: worker launch, first batch)."""
    return [float(ms) for ms in _MS_PER_STEP.findall(run_debug_training(overrides, steps, log_freq, dump))][1:]


def main() -> None:
    args = parser(__doc__.splitlines()[0], workers=True)
    args.add_argument("--flavor", default="debug", help="llama flavor (bench: 85M parameters, 341 MB)")
    args.add_argument("--rounds", type=int, help="alternating on/off rounds (default 9; --quick 5)")
    args.add_argument("--steps", type=int, help="steps per run (default 200; --quick 80)")
    args.add_argument("--log-freq", type=int, help="metrics.log_freq: steps per timed interval (default 20; "
                                                   "--quick 10); the first interval of a run is not timed")
    args, trainer_flags = args.parse_known_args()  # the rest goes to the trainer, on and off alike
    defaults = (5, 80, 10) if args.quick else (9, 200, 20)
    rounds, steps, log_freq = (given or default for given, default in zip((args.rounds, args.steps, args.log_freq),
                                                                         defaults))
    if steps < 2 * log_freq:
        raise SystemExit(f"--steps {steps} gives no timed interval: it must be at least 2 x --log-freq ({log_freq})")
    common = ["--data.num_workers", str(args.workers), "--model.flavor", args.flavor, *trainer_flags]
    times: dict[str, list[float]] = {"on": [], "off": []}
    round_ratios = []
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(rounds):
            timed: dict[str, list[float]] = {}
            for name in ("on", "off") if index % 2 == 0 else ("off", "on"):  # neither always goes first
                overrides = common if name == "on" else [*common, *FEATURES_OFF]
                timed[name] = step_times(overrides, steps, log_freq, f"{scratch}/{name}{index}")
            on, off = timed["on"], timed["off"]
            times["on"] += on
            times["off"] += off
            round_ratios.append(median(on) / median(off))
    # Other work on the machine only ever adds time: the fastest intervals are the least disturbed.
    best = min(times["on"]) / min(times["off"])
    table(
        f"Benchmark 1: training step time, resume features on vs off ({' '.join(['llama', args.flavor, *trainer_flags])}, "
        f"{args.workers} workers, "
        f"{rounds} alternating rounds x {steps} steps, ms/step per progress line of {log_freq} steps)",
        ["features", "median ms/step", "fastest ms/step", "min..max"],
        [["on", f"{median(times['on']):.2f}", f"{min(times['on']):.2f}", spread(times["on"])],
         ["off", f"{median(times['off']):.2f}", f"{min(times['off']):.2f}", spread(times["off"])],
         ["ratio on/off", f"**{median(round_ratios):.3f}** (median of rounds; target <= 1.01)", f"{best:.3f}",
          f"per round: {spread(round_ratios)}"]],
    )


if __name__ == "__main__":
    main()
