"""Benchmark 2: checkpoint save and load time, everything the resume needs (model, optimizer, lr schedule,
RNG, dataloader, train state) vs. model + optimizer only (target: ratio <= 1.05 for both).

Synchronous saves with the CheckpointManager the trainer uses, one process, alternating full / model +
optimizer so that both see the same disk and load conditions.

    python -m bench.checkpoint_cost [--quick] [--flavor small]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.common import build_run, config_for, folder_bytes, median, parser, scratch_parent, spread, table, timed
from torchtitan_rng.checkpoint.layout import step_dir
from torchtitan_rng.checkpoint.manager import CheckpointManager


def main() -> None:
    args = parser(__doc__.splitlines()[0], workers=True)
    args.add_argument("--flavor", default="small", help="llama flavor (default small, ~3M parameters)")
    args = args.parse_args()
    repeats = 5 if args.quick else 15
    run = build_run(config_for("--model.flavor", args.flavor, "--data.num_workers", str(args.workers)), steps=2)
    kinds = {"full": run.parts, "model + optimizer": run.model_and_optimizer}
    save_s: dict[str, list[float]] = {kind: [] for kind in kinds}
    load_s: dict[str, list[float]] = {kind: [] for kind in kinds}
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(dir=scratch_parent()) as scratch:
        managers = {kind: CheckpointManager(Path(scratch) / kind.replace(" ", ""), parts, interval=1)
                    for kind, parts in kinds.items()}
        # All saves first, as in training (the dataloader's iterator alive), then all loads, as at resume.
        for index in range(repeats):
            for kind, manager in managers.items():
                save_s[kind].append(timed(lambda: manager.save(index)))
                sizes[kind] = folder_bytes(step_dir(manager.folder, index))
        for index in range(repeats):
            for kind, manager in managers.items():
                load_s[kind].append(timed(lambda: manager.load(step_dir(manager.folder, index))))
    rows = [[kind, f"{sizes[kind] / 2**20:.2f}", f"{median(save_s[kind]) * 1e3:.1f}", spread([s * 1e3 for s in save_s[kind]]),
             f"{median(load_s[kind]) * 1e3:.1f}", spread([s * 1e3 for s in load_s[kind]])] for kind in kinds]
    save_ratio = median(save_s["full"]) / median(save_s["model + optimizer"])
    load_ratio = median(load_s["full"]) / median(load_s["model + optimizer"])
    rows.append(["ratio full / model + optimizer", "", f"**{save_ratio:.3f}** (target <= 1.05)", "",
                 f"**{load_ratio:.3f}** (target <= 1.05)", ""])
    table(f"Benchmark 2: checkpoint cost, llama {args.flavor}, {args.workers} dataloader workers, {repeats} saves each",
          ["checkpoint", "MiB", "save ms (median)", "save min..max", "load ms (median)", "load min..max"], rows)


if __name__ == "__main__":
    main()
