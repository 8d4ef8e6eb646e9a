"""Benchmark: step time and peak memory of tensor parallelism in the ordinary mode (tp 2 on 2 processes) against
one process, the same model, data and samples per step.

Each layout is one launch of the real trainer (gloo on the CPU); its progress lines (every ``--log-freq`` steps)
give the time per step (the first line, start-up and the first step, left out) and rank 0's memory as the
progress line reports it (on the CPU the process's peak resident size, which includes the interpreter and torch:
what a rank needs). The layouts alternate over rounds, so that drift in the machine's load hits them alike; the
table gives each layout's median step time and peak memory, and both as ratios to one process.

    python -m bench.tensor_parallel [--quick] [--flavor bench] [--rounds R --steps S --log-freq F]
"""

from __future__ import annotations

from bench.common import launch_times, median, parser, spread, table

_BASELINE = "1 process"
# (processes, overrides): the same samples per step (local batch x data shards) on every layout.
LAYOUTS = {
    _BASELINE: (1, []),
    "tp 2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
}


def main() -> None:
    args = parser(__doc__.splitlines()[0])
    args.add_argument("--flavor", default="bench", help="llama flavor (bench: 85M parameters, 12 heads)")
    args.add_argument("--local-batch-size", type=int, default=2)
    args.add_argument("--rounds", type=int, default=0)
    args.add_argument("--steps", type=int, default=0)
    args.add_argument("--log-freq", type=int, default=2)
    args = args.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    steps = args.steps or (6 if args.quick else 8)
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    memory: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    common = ["--model.flavor", args.flavor, "--training.local_batch_size", str(args.local_batch_size)]
    for round_index in range(rounds):
        order = list(LAYOUTS) if round_index % 2 == 0 else list(reversed(LAYOUTS))
        for name in order:
            nproc, overrides = LAYOUTS[name]
            step_ms, peak = launch_times([*overrides, *common], nproc, steps, args.log_freq)
            times[name] += step_ms
            memory[name].append(peak)
    base_time, base_memory = median(times[_BASELINE]), median(memory[_BASELINE])
    rows = [[name, f"{median(times[name]):.0f}", spread(times[name]), f"{median(times[name]) / base_time:.2f}",
             f"{median(memory[name]):.2f}", f"{median(memory[name]) / base_memory:.2f}"] for name in LAYOUTS]
    table(f"Tensor parallelism, ordinary mode: step time and rank 0's peak memory (llama {args.flavor}, local batch "
          f"{args.local_batch_size} of 64 tokens, {rounds} round(s) of {steps} steps, every {args.log_freq}th step "
          "timed after the first)",
          ["layout", "ms/step (median)", "min..max", "vs 1 process", "peak memory GiB (rank 0)", "vs 1 process"],
          rows)


if __name__ == "__main__":
    main()
