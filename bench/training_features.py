"""Benchmark 10: step time with each training feature, and the resume machinery on vs off for each.

Features (the llama debug config, one process, 2 dataloader workers): plain; gradient accumulation (2
micro-batches per step); activation checkpointing (full, selective per op); bf16 autocast; torch.compile
(model and loss); all of them together. For each, the step time with the resume machinery on (the
defaults: dataloader snapshots every checkpoint.interval steps, worker RNG capture, the stop-signal check)
and off (as in benchmark 1), in alternating rounds, in one process. Compile warm-up and start-up fall in the first
progress line, which is left out.

    python -m bench.training_features [--quick]
"""

from __future__ import annotations

import tempfile

from bench.common import median, parser, table
from bench.step_time import FEATURES_OFF, step_times

FEATURES: dict[str, list[str]] = {
    "plain": [],
    "accumulation x2": ["--training.global_batch_size", "16"],
    "AC full": ["--activation_checkpoint.mode", "full"],
    "AC selective (op)": ["--activation_checkpoint.mode", "selective"],
    "bf16 autocast": ["--training.mixed_precision_param", "bfloat16"],
    "compile": ["--compile.enable"],
}
FEATURES["all together"] = [arg for name in ("accumulation x2", "AC selective (op)", "bf16 autocast", "compile")
                            for arg in FEATURES[name]]


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    rounds, steps, log_freq = (2, 30, 10) if args.quick else (5, 120, 20)
    common = ["--data.num_workers", "2"]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        plain_on: float | None = None
        for name, overrides in FEATURES.items():
            times: dict[str, list[float]] = {"on": [], "off": []}
            for index in range(rounds):
                for mode, extra in (("on", []), ("off", FEATURES_OFF)):
                    dump = f"{scratch}/{len(rows)}-{mode}{index}"
                    times[mode] += step_times([*common, *overrides, *extra], steps, log_freq, dump)
            on, off = median(times["on"]), median(times["off"])
            plain_on = on if plain_on is None else plain_on
            rows.append([name, f"{on:.2f}", f"{off:.2f}", f"**{on / off:.3f}**", f"{on / plain_on:.2f}"])
    table(
        f"Benchmark 10: step time per training feature, resume machinery on vs off (llama debug, 1 process, "
        f"2 workers, {rounds} rounds x {steps} steps, medians of progress lines of {log_freq} steps)",
        ["feature", "on ms/step", "off ms/step", "ratio on/off", "vs plain (on)"],
        rows,
    )


if __name__ == "__main__":
    main()
