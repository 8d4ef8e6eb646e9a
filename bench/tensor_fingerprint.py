"""Benchmark 14: what debug.tensor_fingerprint costs: host reads per step and step time, the option on vs off.

Off, the trainer builds no recorder: the reads per step must be those of benchmark 9. On, each step hashes
its batches, losses, gradients, parameters and optimizer state on the device (one reduction per tensor) and
reads them at the loss log's sync points only: one more read per device per sync point. Step time: the real trainer,
runs alternating off/on (each round swapping which goes first), the median over rounds of each round's on/off
ratio of median step times; the reads are counted as benchmark 9 counts them (a run of S and of 3S steps). On a
shared machine the step times move more than the option costs, so the hashing a step adds is also timed alone
(fastest of 5): every gradient, parameter and optimizer-state tensor of the model, after a real step.

    python -m bench.tensor_fingerprint [--quick] [--workers N] [--flavor bench] [--rounds R --steps S --log-freq F]
"""

from __future__ import annotations

import tempfile

from bench.common import build_run, config_for, median, parser, spread, table, timed
from bench.host_syncs import reads_in_run
from bench.step_time import step_times
from torchtitan_rng.diagnosis.tensor_fingerprints import tensor_hash

ON = ["--debug.tensor_fingerprint"]


def hashing_alone(flavor: str) -> tuple[float, int, int]:
    """(fastest ms, tensors, bytes): the per-step hashes of the model's gradients, parameters and AdamW state."""
    run = build_run(config_for("--model.flavor", flavor))
    tensors = [t for p in run.model.parameters() for t in (p, p.grad) if t is not None]
    tensors += [t for state in run.optimizer.state.values() for t in state.values() if t.dim() > 0]
    ms = min(timed(lambda: [tensor_hash(t) for t in tensors]) for _ in range(5)) * 1000
    return ms, len(tensors), sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    args = parser(__doc__.splitlines()[0], workers=True)
    args.add_argument("--flavor", default="debug", help="llama flavor (bench: 85M parameters, 341 MB)")
    args.add_argument("--rounds", type=int, help="alternating off/on rounds (default 7; --quick 3)")
    args.add_argument("--steps", type=int, help="steps per timed run (default 100; --quick 40)")
    args.add_argument("--log-freq", type=int, help="metrics.log_freq (default 10); the first interval is not timed")
    args = args.parse_args()
    rounds, steps = (args.rounds or (3 if args.quick else 7)), (args.steps or (40 if args.quick else 100))
    log_freq = args.log_freq or 10
    if steps < 2 * log_freq:
        raise SystemExit(f"--steps {steps} gives no timed interval: it must be at least 2 x --log-freq ({log_freq})")
    common = ["--data.num_workers", str(args.workers), "--model.flavor", args.flavor]
    times: dict[str, list[float]] = {"off": [], "on": []}
    reads: dict[str, dict[str, float]] = {}
    ratios = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in ("off", "on"):
            flags = common + (ON if name == "on" else [])
            short = reads_in_run(log_freq, log_freq, flags, f"{scratch}/reads_short_{name}")
            long = reads_in_run(3 * log_freq, log_freq, flags, f"{scratch}/reads_long_{name}")
            reads[name] = {key: (long[key] - short[key]) / (2 * log_freq) for key in long}
        for index in range(rounds):
            timed = {}
            for name in ("off", "on") if index % 2 == 0 else ("on", "off"):
                flags = common + (ON if name == "on" else [])
                timed[name] = step_times(flags, steps, log_freq, f"{scratch}/{name}{index}")
                times[name] += timed[name]
            ratios.append(median(timed["on"]) / median(timed["off"]))

    ms, count, size = hashing_alone(args.flavor)

    def device(name: str) -> str:
        return f"{reads[name]['device']:.2f}" if "device" in reads[name] else "n/a (no accelerator)"

    table(f"Benchmark 14: debug.tensor_fingerprint off vs on (llama {args.flavor}, {args.workers} workers, "
          f"metrics.log_freq {log_freq}, {rounds} alternating rounds x {steps} steps)",
          ["debug.tensor_fingerprint", "reads by the trainer / step", "device syncs / step", "median ms/step",
           "fastest ms/step", "min..max", "on / off (median of rounds)"],
          [[name, f"{reads[name]['trainer']:.2f}", device(name), f"{median(times[name]):.2f}",
            f"{min(times[name]):.2f}", spread(times[name]),
            f"**{median(ratios):.3f}** (rounds {min(ratios):.3f}..{max(ratios):.3f})" if name == "on" else ""]
           for name in ("off", "on")])
    table(f"Benchmark 14: the hashing a step adds, alone (llama {args.flavor}, fastest of 5)",
          ["tensors hashed / step", "bytes read", "ms / step"], [[count, f"{size / 2**20:.1f} MiB", f"**{ms:.2f}**"]])


if __name__ == "__main__":
    main()
