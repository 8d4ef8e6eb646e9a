"""Benchmark: what a test's training launch costs started as a new interpreter (cold) and forked from the
test suite's warm server (tests/support/zygote.py), side by side in one run: a 1-step run (start-up, one step,
exit: the seconds to the first step and a little), a 20-step run, and a refusal (a bad key: start-up and one
line), on 1 and 2 processes (the launcher, torchrun, gloo).

    python -m bench.test_launches [--quick]
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import DEBUG_CONFIG, machine, median, parser, spread, table
from tests.support import zygote
from tests.support.launch import run_env
from torchtitan_rng.launch.runs import training_command

SHAPES = {  # name: overrides
    "1 step": ("--training.steps", "1"),
    "20 steps": (),
    "refusal": ("--training.stepz", "1"),
}


def launch(command: list[str], warm: bool) -> float:
    env = run_env()
    started = time.monotonic()
    proc = zygote.run(command, env=env, cwd=Path.cwd()) if warm else None
    if proc is None:
        if warm:
            raise SystemExit("the warm server refused the command; nothing to compare")
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.monotonic() - started
    if proc.returncode not in (0, 2):
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}\n{proc.stderr[-2000:]}")
    return seconds


def main() -> None:
    opts = parser(__doc__.split("\n\n")[0]).parse_args()
    repeats = 2 if opts.quick else 5
    print(machine())
    scratch = Path(tempfile.mkdtemp(prefix="bench_test_launches_"))
    zygote.run([sys.executable, "-m", "json.tool", "--help"], env=run_env(), cwd=Path.cwd())  # its start-up
    rows = []
    for nproc in (1, 2):
        for name, overrides in SHAPES.items():
            times: dict[bool, list[float]] = {False: [], True: []}
            for repeat in range(repeats):
                for warm in (False, True):  # interleaved: both see the same machine
                    dump = scratch / f"{nproc}-{name}-{repeat}-{warm}"
                    args = ["--job.dump_folder", str(dump), "--metrics.log_freq", "1000", *overrides]
                    times[warm].append(launch(training_command(DEBUG_CONFIG, args, nproc), warm))
                    shutil.rmtree(dump, ignore_errors=True)
            cold, warm = median(times[False]), median(times[True])
            rows.append([nproc, name, f"{cold:.2f} ({spread(times[False])})", f"{warm:.2f} ({spread(times[True])})",
                         f"{cold / warm:.1f}x"])
    table(f"seconds per launch, median of {repeats} (spread)", ["processes", "run", "cold", "warm", "ratio"], rows)
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
