"""Benchmark 14: what debug.tensor_fingerprint costs: host reads per step and step time, the option on vs off.

Off, the trainer builds no recorder: the reads per step must be those of benchmark 9. On, each step hashes
its batches, losses, gradients and parameters on the device (one reduction per tensor; the optimizer state only
where a process starts and at saves, which this benchmark does not make) and reads them at the loss log's sync
points only: one more read per device per sync point; a third mode hashes the optimizer state at every step too
(debug.fingerprint_optimizer_every_step). Step time: the real trainer, the modes run in turn (each round another
goes first), the median over rounds of each round's ratio to off of median step times; the
reads are counted as benchmark 9 counts them (a run of S and of 3S steps). The hashes read every gradient and
parameter once a step, so their share of a step shrinks as the step computes more per parameter: ``--seq-len``
times each length given (the debug config's batch of 8 samples). On a shared machine the step times move more than
the option costs, so the hashing a step adds is also timed alone (fastest of 5): every gradient and parameter of
the model, after a real step, and the optimizer state a save adds.

    python -m bench.tensor_fingerprint [--quick] [--workers N] [--flavor bench] [--seq-len L [L ...]]
        [--rounds R --steps S --log-freq F]
"""

from __future__ import annotations

import tempfile

from bench.common import build_run, config_for, median, parser, spread, table, timed
from bench.host_syncs import reads_in_run
from bench.step_time import step_times
from torchtitan_rng.diagnosis.tensor_fingerprints import tensor_hash

ON = ["--debug.tensor_fingerprint"]
# The modes timed side by side: the option off, on (the optimizer state hashed at saves only), and on with the
# optimizer state hashed at every step as well (debug.fingerprint_optimizer_every_step).
MODES = {"off": [], "on": ON, "on, optimizer state every step": [*ON, "--debug.fingerprint_optimizer_every_step"]}


def hashing_alone(flavor: str) -> list[list[str]]:
    """Rows (what, tensors, MiB read, fastest ms): the hashes of the model's gradients and parameters that every
    step adds, and those of its AdamW state that a save adds."""
    run = build_run(config_for("--model.flavor", flavor))
    groups = {"every step: gradients and parameters":
              [t for p in run.model.parameters() for t in (p, p.grad) if t is not None],
              "a save: the optimizer state":
              [t for state in run.optimizer.state.values() for t in state.values() if t.dim() > 0]}
    rows = []
    for what, tensors in groups.items():
        ms = min(timed(lambda: [tensor_hash(t) for t in tensors]) for _ in range(5)) * 1000
        rows.append([what, str(len(tensors)), f"{sum(t.numel() * t.element_size() for t in tensors) / 2**20:.1f}",
                     f"**{ms:.2f}**"])
    return rows


def main() -> None:
    args = parser(__doc__.splitlines()[0], workers=True)
    args.add_argument("--flavor", default="debug", help="llama flavor (bench: 85M parameters, 341 MB)")
    args.add_argument("--seq-len", type=int, nargs="+", default=[64],
                      help="training.seq_len of each timed shape (default 64, the debug config's)")
    args.add_argument("--rounds", type=int, help="rounds of the modes in turn (default 7; --quick 3)")
    args.add_argument("--steps", type=int, help="steps per timed run (default 100; --quick 40)")
    args.add_argument("--log-freq", type=int, help="metrics.log_freq (default 10); the first interval is not timed")
    args = args.parse_args()
    rounds, steps = (args.rounds or (3 if args.quick else 7)), (args.steps or (40 if args.quick else 100))
    log_freq = args.log_freq or 10
    if steps < 2 * log_freq:
        raise SystemExit(f"--steps {steps} gives no timed interval: it must be at least 2 x --log-freq ({log_freq})")
    common = ["--data.num_workers", str(args.workers), "--model.flavor", args.flavor]
    batch = config_for().training.local_batch_size
    names = list(MODES)
    reads: dict[str, dict[str, float]] = {}
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in ("off", "on"):
            short = reads_in_run(log_freq, log_freq, common + MODES[name], f"{scratch}/reads_short_{name}")
            long = reads_in_run(3 * log_freq, log_freq, common + MODES[name], f"{scratch}/reads_long_{name}")
            reads[name] = {key: (long[key] - short[key]) / (2 * log_freq) for key in long}
        for seq_len in args.seq_len:
            shape = [*common, "--training.seq_len", str(seq_len)]
            times: dict[str, list[float]] = {name: [] for name in names}
            ratios: dict[str, list[float]] = {name: [] for name in names[1:]}
            for index in range(rounds):
                timed_runs = {}
                for name in names[index % len(names):] + names[:index % len(names)]:  # each mode goes first in turn
                    timed_runs[name] = step_times(shape + MODES[name], steps, log_freq,
                                                  f"{scratch}/{seq_len}_{names.index(name)}_{index}")
                    times[name] += timed_runs[name]
                for name in ratios:
                    ratios[name].append(median(timed_runs[name]) / median(timed_runs["off"]))
            rows += [[f"{batch} x {seq_len}", name, f"{median(times[name]):.2f}", f"{min(times[name]):.2f}",
                      spread(times[name]),
                      f"**{median(ratios[name]):.3f}** (rounds {min(ratios[name]):.3f}..{max(ratios[name]):.3f})"
                      if name in ratios else ""]
                     for name in names]

    def device(name: str) -> str:
        return f"{reads[name]['device']:.2f}" if "device" in reads[name] else "n/a (no accelerator)"

    table(f"Benchmark 14: host reads per step, debug.tensor_fingerprint off vs on (llama {args.flavor}, "
          f"{args.workers} workers, metrics.log_freq {log_freq})",
          ["debug.tensor_fingerprint", "reads by the trainer / step", "device syncs / step"],
          [[name, f"{reads[name]['trainer']:.2f}", device(name)] for name in ("off", "on")])
    table(f"Benchmark 14: step time, debug.tensor_fingerprint off vs on (llama {args.flavor}, {args.workers} "
          f"workers, metrics.log_freq {log_freq}, {rounds} rounds x {steps} steps per mode and shape)",
          ["samples x tokens per step", "debug.tensor_fingerprint", "median ms/step", "fastest ms/step", "min..max",
           "/ off (median of rounds)"], rows)
    table(f"Benchmark 14: the hashing alone (llama {args.flavor}, fastest of 5)",
          ["hashed", "tensors", "MiB read", "ms"], hashing_alone(args.flavor))


if __name__ == "__main__":
    main()
