"""Benchmark 16: step time and memory of the world-size-invariant mode with tensor parallelism (layers computed in
``parallelism.tensor_parallel_chunks`` chunks, partials exchanged and summed by the chunk tree) vs the ordinary
mode's tensor parallelism (torch's DTensor styles) at the same layout, tp 2 and dp 2 x tp 2 (targets:
invariant/ordinary <= 1.25 in step time, <= 1.2 in memory).

Both train the same micro-batches: one of ``training.local_batch_size`` per data shard per step, so both run the
same shapes and differ only in what the mode changes (the chunked matmuls, the exchange of partials in place of
the all-reduce, per-micro-batch seeding, the slot-order exchange and float32 gathers of FSDP2 at dp 2, the exact
grad norm, deterministic kernels). Every process runs one intra-op thread in both. Each is a real run_train.sh
launch; its progress lines give ms per step, and the peak resident memory of rank 0 (on the CPU) or its
allocated device memory. The runs alternate so that drift in the machine's load hits both alike.

    python -m bench.tensor_parallel_invariant [--quick] [--flavor small] [--local-batch 8] [--steps 30]
"""

from __future__ import annotations

import tempfile

from bench.common import median, parser, spread, table
from bench.world_size_invariant import step_times

# (processes, tensor-parallel degree): the layouts compared.
LAYOUTS = ((2, 2), (4, 2))


def main() -> None:
    args = parser(__doc__.splitlines()[0])
    args.add_argument("--flavor", default="small", help="llama flavor (default small; bench: 85M parameters)")
    args.add_argument("--local-batch", type=int, default=8, help="samples per micro-batch (default 8)")
    args.add_argument("--steps", type=int, help="steps per run (default 30, 60 without --quick); progress "
                      "lines every steps/3")
    args = args.parse_args()
    rounds, steps = (2, 30) if args.quick else (4, 60)
    steps = args.steps or steps
    log_freq = max(1, steps // 3)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for nproc, tp in LAYOUTS:
            layout = f"tp {tp}" if nproc == tp else f"dp {nproc // tp} x tp {tp}"
            times: dict[bool, list[float]] = {False: [], True: []}
            memory: dict[bool, float] = {}
            for index in range(rounds):
                for invariant in (False, True):
                    ms, gib = step_times(nproc, invariant, args.flavor, steps, log_freq, args.local_batch,
                                         f"{scratch}/{nproc}-{invariant}-{index}", nproc // tp,
                                         "--parallelism.tensor_parallel_degree", str(tp))
                    times[invariant] += ms
                    memory[invariant] = gib
            for invariant, name in ((False, "ordinary (DTensor)"), (True, "world-size-invariant (chunks)")):
                rows.append([layout, name, f"{min(times[invariant]):.1f}", f"{median(times[invariant]):.1f}",
                             spread(times[invariant]), f"{memory[invariant]:.2f}"])
            # Other work on the machine only ever adds time: the fastest intervals are the least disturbed.
            rows.append([layout, "ratio invariant/ordinary", f"**{min(times[True]) / min(times[False]):.3f}**",
                         f"{median(times[True]) / median(times[False]):.3f}", "(target <= 1.25)",
                         f"**{memory[True] / memory[False]:.2f}** (target <= 1.2)"])
    table(f"Benchmark 16: world-size-invariant vs ordinary tensor parallelism (llama {args.flavor}, one micro-batch "
          f"of {args.local_batch} per data shard per step, {rounds} rounds x {steps} steps, ms/step per progress line "
          f"of {log_freq} steps; memory: rank 0's peak RSS on the CPU, allocated device memory on an accelerator)",
          ["layout", "mode", "fastest ms/step", "median ms/step", "min..max", "memory GiB"], rows)


if __name__ == "__main__":
    main()
