"""Benchmark 3: how long a checkpoint save blocks the training loop, async vs. sync, for a model of
>= 100 MB (target: async <= 0.2x sync).

The llama "bench" flavor (85M parameters, 0.34 GB of weights, 1.0 GB with AdamW's state) after a real
training step. Blocked time is the time ``save()`` takes to return: sync writes everything; async copies
the state (staging) and returns while DCP writes in the background. The background write time is shown
too: a checkpoint interval whose steps take longer than it never waits for the previous save. The first
async save of a run also allocates the CPU copy it stages into (kept for the run), so it is shown apart.

    python -m bench.async_blocking [--quick] [--flavor bench]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.common import build_run, config_for, folder_bytes, median, parser, scratch_parent, spread, table, timed
from torchtitan_rng.checkpoint.layout import step_dir
from torchtitan_rng.checkpoint.manager import CheckpointManager


def main() -> None:
    args = parser(__doc__.splitlines()[0])
    args.add_argument("--flavor", default="bench", help="llama flavor (default bench, 85M parameters)")
    args = args.parse_args()
    repeats = 4 if args.quick else 8
    run = build_run(config_for("--model.flavor", args.flavor, "--training.local_batch_size", "1"), steps=1)
    blocked: dict[str, list[float]] = {"sync": [], "async": []}
    background: list[float] = []
    with tempfile.TemporaryDirectory(dir=scratch_parent()) as scratch:
        sync = CheckpointManager(Path(scratch) / "sync", run.parts, interval=1)
        asynchronous = CheckpointManager(Path(scratch) / "async", run.parts, interval=1, async_mode="async")
        for index in range(repeats):
            blocked["sync"].append(timed(lambda: sync.save(index)))
            blocked["async"].append(timed(lambda: asynchronous.save(index)))
            background.append(timed(asynchronous.wait))  # nothing overlaps here: the write's own duration
        size = folder_bytes(step_dir(sync.folder, 0))
    # The first async save also allocates the staging copy (kept for the run); later saves reuse it.
    steady = {mode: times[1:] for mode, times in blocked.items()}
    ratio = median(steady["async"]) / median(steady["sync"])
    table(
        f"Benchmark 3: time the loop is blocked per save, llama {args.flavor} "
        f"({size / 2**20:.0f} MiB checkpoint), {repeats} saves each",
        ["mode", "first save: blocked s", "later saves: blocked s (median)", "later: min..max",
         "background write s (median)"],
        [["sync", f"{blocked['sync'][0]:.2f}", f"{median(steady['sync']):.2f}", spread(steady["sync"]), "-"],
         ["async", f"{blocked['async'][0]:.2f}", f"{median(steady['async']):.2f}", spread(steady["async"]),
          f"{median(background):.2f}"],
         ["ratio async / sync", "", f"**{ratio:.3f}** (target <= 0.2)", "", ""]],
    )

if __name__ == "__main__":
    main()
