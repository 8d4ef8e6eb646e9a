"""Benchmark 11: step time and memory of world-size-invariant training (sharded by FSDP2, gradients summed in slot
order) vs ordinary data parallelism (FSDP2) at 2 and 4 processes (targets: invariant/ordinary <= 1.15 in step
time, <= 1.25 in memory).

Both train the same global batch of the same micro-batches: one micro-batch of ``training.local_batch_size``
per process per step, so both run the same forward and backward shapes and differ only in what the mode
changes (per-micro-batch seeding, float32 parameter gathers, the all-to-all and the slot-order additions in
place of the reduce-scatter, the exact grad norm, deterministic kernels). Every process runs one intra-op
thread in both. Each is a real run_train.sh launch; its progress lines give ms per step, and the peak resident
memory of rank 0 (on the CPU) or its allocated device memory. The runs alternate so that drift in the
machine's load hits both alike.

    python -m bench.world_size_invariant [--quick] [--flavor bench] [--local-batch 1] [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable

from bench.common import DEBUG_CONFIG, REPO, median, parser, spread, table

_PROGRESS = re.compile(r"\s([\d.]+) ms/step\s+(?:peak rss|mem) ([\d.]+) GiB")


def step_times(nproc: int, invariant: bool, flavor: str, steps: int, log_freq: int, local: int,
               dump: str, shards: int = 0, *extra: str) -> tuple[list[float], float]:
    """(ms per step of each progress line but the first, which holds start-up; the last line's memory GiB);
    ``shards``: the data shards, one micro-batch each per step (0: every process its own); ``extra``: more
    overrides."""
    args = ["--job.dump_folder", dump, "--model.flavor", flavor, "--training.steps", str(steps),
            "--metrics.log_freq", str(log_freq), "--training.local_batch_size", str(local), *extra]
    if invariant:
        args += ["--parallelism.world_size_invariant", "--training.global_batch_size", str(local * (shards or nproc))]
    env = {**os.environ, "NGPU": str(nproc), "CONFIG_FILE": str(DEBUG_CONFIG), "PYTHON": sys.executable,
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(["bash", str(REPO / "run_train.sh"), *args], cwd=REPO, capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        raise SystemExit(f"the training run exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    lines = _PROGRESS.findall(proc.stdout)
    return [float(ms) for ms, _ in lines][1:], float(lines[-1][1])


def compare_modes(label: object, names: tuple[str, str], targets: tuple[str, str], rounds: int,
                  run: Callable[[bool, int], tuple[list[float], float]]) -> list[list[object]]:
    """The table rows of one layout: the ordinary and the invariant mode (``names``), timed alternately over
    ``rounds`` by ``run(invariant, round)``, and their ratios against ``targets`` (step time, memory)."""
    times: dict[bool, list[float]] = {False: [], True: []}
    memory: dict[bool, float] = {}
    for index in range(rounds):
        for invariant in (False, True):
            ms, gib = run(invariant, index)
            times[invariant] += ms
            memory[invariant] = gib
    rows: list[list[object]] = [[label, name, f"{min(times[invariant]):.1f}", f"{median(times[invariant]):.1f}",
                                 spread(times[invariant]), f"{memory[invariant]:.2f}"]
                                for invariant, name in ((False, names[0]), (True, names[1]))]
    # Other work on the machine only ever adds time: the fastest intervals are the least disturbed.
    rows.append([label, "ratio invariant/ordinary", f"**{min(times[True]) / min(times[False]):.3f}**",
                 f"{median(times[True]) / median(times[False]):.3f}", f"(target <= {targets[0]})",
                 f"**{memory[True] / memory[False]:.2f}** (target <= {targets[1]})"])
    return rows


def mode_arguments(doc: str) -> tuple[argparse.Namespace, int, int, int]:
    """The command line of a benchmark of the two modes: (its arguments, rounds, steps per run, log_freq)."""
    args = parser(doc.splitlines()[0])
    args.add_argument("--flavor", default="small", help="llama flavor (default small; bench: 85M parameters)")
    args.add_argument("--local-batch", type=int, default=8, help="samples per micro-batch (default 8)")
    args.add_argument("--steps", type=int, help="steps per run (default 30, 60 without --quick); progress "
                      "lines every steps/3")
    args = args.parse_args()
    rounds, steps = (2, 30) if args.quick else (4, 60)
    steps = args.steps or steps
    return args, rounds, steps, max(1, steps // 3)


def main() -> None:
    args, rounds, steps, log_freq = mode_arguments(__doc__)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for nproc in (2, 4):
            rows += compare_modes(nproc, ("ordinary (FSDP2)", "world-size-invariant"), ("1.15", "1.25"), rounds,
                                  lambda invariant, index, nproc=nproc: step_times(
                                      nproc, invariant, args.flavor, steps, log_freq, args.local_batch,
                                      f"{scratch}/{nproc}-{invariant}-{index}"))
    table(f"Benchmark 11: world-size-invariant vs ordinary data parallelism (llama {args.flavor}, one micro-batch "
          f"of {args.local_batch} per process per step, {rounds} rounds x {steps} steps, ms/step per progress line of "
          f"{log_freq} steps; memory: rank 0's peak RSS on the CPU, allocated device memory on an accelerator)",
          ["processes", "mode", "fastest ms/step", "median ms/step", "min..max", "memory GiB"], rows)


if __name__ == "__main__":
    main()
