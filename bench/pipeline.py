"""Benchmark: training step time with pipeline parallelism (pp 2 under each schedule) against none (FSDP2
over the same processes), the same model, data and process count; and the cost of the world-size-invariant mode
under pp 2 (GPipe, 1F1B) against the same schedule in the ordinary mode, on the same samples per step.

Each layout is one launch of the real trainer (gloo on the CPU); its progress lines (every ``--log-freq``
steps) give the time per step, and the first line (start-up, first-step shape inference) is left out. The
layouts alternate over rounds, so that drift in the machine's load hits them alike; the table gives each
layout's median step time and its ratio to no pipeline (an invariant layout's also to its ordinary layout).

    python -m bench.pipeline [--quick] [--flavor debug4] [--nproc 2] [--rounds R --steps S --log-freq F]
                             [--only NAME ...]
"""

from __future__ import annotations

from bench.common import launch_times, median, parser, spread, table

# pp 2 with micro-batches of 2 samples: a schedule run of 4 micro-batches (local batch 8).
_PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
_BASELINE = "no pipeline (FSDP2 over all)"
LAYOUTS = {
    _BASELINE: [],
    "pp 2, GPipe": [*_PP2, "--parallelism.pipeline_parallel_schedule", "GPipe"],
    "pp 2, 1F1B": [*_PP2, "--parallelism.pipeline_parallel_schedule", "1F1B"],
    "pp 2, Interleaved1F1B": [*_PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
}
# The invariant mode on the same 8 samples per step: 4 micro-batches of 2, all in one schedule run.
_INVARIANT = ["--parallelism.world_size_invariant", "--training.local_batch_size", "2",
              "--training.global_batch_size", "8"]
for _schedule in ("GPipe", "1F1B"):
    LAYOUTS[f"pp 2, {_schedule}, invariant"] = [*LAYOUTS[f"pp 2, {_schedule}"], *_INVARIANT]


def _vs_ordinary(name: str, times: dict[str, list[float]]) -> str:
    """An invariant layout's median over its ordinary layout's (blank for the others, or when that was not timed)."""
    ordinary = times.get(name.removesuffix(", invariant"))
    return f"{median(times[name]) / median(ordinary):.2f}" if name.endswith(", invariant") and ordinary else ""


def main() -> None:
    args = parser(__doc__.splitlines()[0])
    args.add_argument("--flavor", default="debug4", help="llama flavor (debug4: 4 blocks, enough for 4 stages)")
    args.add_argument("--nproc", type=int, default=2)
    args.add_argument("--rounds", type=int, default=0)
    args.add_argument("--steps", type=int, default=0)
    args.add_argument("--log-freq", type=int, default=4)
    args.add_argument("--only", action="append", default=[],
                      help="time only the layouts whose name contains this (repeatable); no pipeline always runs")
    args = args.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    steps = args.steps or (12 if args.quick else 24)
    chosen = [name for name in LAYOUTS
              if name == _BASELINE or not args.only or any(part in name for part in args.only)]
    times: dict[str, list[float]] = {name: [] for name in chosen}
    for round_index in range(rounds):
        order = chosen if round_index % 2 == 0 else list(reversed(chosen))
        for name in order:
            times[name] += launch_times([*LAYOUTS[name], "--model.flavor", args.flavor], args.nproc, steps,
                                        args.log_freq)[0]
    baseline = median(times[_BASELINE])
    rows = [[name, f"{median(values):.1f}", spread(values), f"{median(values) / baseline:.2f}",
             _vs_ordinary(name, times)] for name, values in times.items()]
    table(f"Pipeline parallelism: step time on {args.nproc} processes (llama {args.flavor}, local batch 8, "
          f"{rounds} round(s) of {steps} steps, every {args.log_freq}th step timed after the first)",
          ["layout", "ms/step (median)", "min..max", "vs no pipeline", "vs ordinary"], rows)


if __name__ == "__main__":
    main()
