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

from bench.common import table
from bench.world_size_invariant import compare_modes, mode_arguments, step_times

# (processes, tensor-parallel degree): the layouts compared.
LAYOUTS = ((2, 2), (4, 2))


def main() -> None:
    args, rounds, steps, log_freq = mode_arguments(__doc__)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for nproc, tp in LAYOUTS:
            layout = f"tp {tp}" if nproc == tp else f"dp {nproc // tp} x tp {tp}"
            rows += compare_modes(layout, ("ordinary (DTensor)", "world-size-invariant (chunks)"), ("1.25", "1.2"),
                                  rounds, lambda invariant, index, nproc=nproc, tp=tp: step_times(
                                      nproc, invariant, args.flavor, steps, log_freq, args.local_batch,
                                      f"{scratch}/{nproc}-{invariant}-{index}", nproc // tp,
                                      "--parallelism.tensor_parallel_degree", str(tp)))
    table(f"Benchmark 16: world-size-invariant vs ordinary tensor parallelism (llama {args.flavor}, one micro-batch "
          f"of {args.local_batch} per data shard per step, {rounds} rounds x {steps} steps, ms/step per progress line "
          f"of {log_freq} steps; memory: rank 0's peak RSS on the CPU, allocated device memory on an accelerator)",
          ["layout", "mode", "fastest ms/step", "median ms/step", "min..max", "memory GiB"], rows)


if __name__ == "__main__":
    main()
