"""Benchmark 8: the cost of checkpoint checksums: save with checksums.json written vs without, and load
with every file verified first vs load alone (target: ratio <= 1.05 for both).

Synchronous saves of a full checkpoint with the trainer's CheckpointManager, one process, alternating
with / without so that both see the same disk and page-cache conditions. "Without" swaps the checksum
writer for a no-op for that save only.

    python -m bench.integrity_cost [--quick] [--flavor small]
"""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from bench.common import build_run, config_for, folder_bytes, median, parser, scratch_parent, spread, table, timed
from torchtitan_rng.checkpoint import integrity
from torchtitan_rng.checkpoint.integrity import verify_integrity
from torchtitan_rng.checkpoint.layout import step_dir
from torchtitan_rng.checkpoint.manager import CheckpointManager


@contextmanager
def checksums_off() -> Iterator[None]:
    writer = integrity.write_checksums
    integrity.write_checksums = lambda folder: None
    try:
        yield
    finally:
        integrity.write_checksums = writer


def main() -> None:
    args = parser(__doc__.splitlines()[0])
    args.add_argument("--flavor", default="small", help="llama flavor (default small, ~3M parameters)")
    args = args.parse_args()
    repeats = 5 if args.quick else 15
    run = build_run(config_for("--model.flavor", args.flavor, "--data.num_workers", "2"), steps=2)
    save_s: dict[str, list[float]] = {"with": [], "without": []}
    load_s: dict[str, list[float]] = {"with": [], "without": []}
    with tempfile.TemporaryDirectory(dir=scratch_parent()) as scratch:
        manager = CheckpointManager(Path(scratch), run.parts, interval=1)
        for index in range(repeats):
            save_s["with"].append(timed(lambda: manager.save(2 * index)))
            with checksums_off():
                save_s["without"].append(timed(lambda: manager.save(2 * index + 1)))
        size = folder_bytes(step_dir(manager.folder, 0))
        # The checksum work alone (no DCP around it): less noisy than the difference of two saves.
        alone_write = median([timed(lambda: integrity.write_checksums(step_dir(manager.folder, 0)))
                              for _ in range(repeats)])
        alone_verify = median([timed(lambda: verify_integrity(step_dir(manager.folder, 0))) for _ in range(repeats)])
        for index in range(repeats):
            verified = step_dir(manager.folder, 2 * index)
            load_s["with"].append(timed(lambda: (verify_integrity(verified), manager.load(verified))))
            load_s["without"].append(timed(lambda: manager.load(step_dir(manager.folder, 2 * index + 1))))
    rows = [[kind, f"{median(save_s[kind]) * 1e3:.1f}", spread([s * 1e3 for s in save_s[kind]]),
             f"{median(load_s[kind]) * 1e3:.1f}", spread([s * 1e3 for s in load_s[kind]])] for kind in ("with", "without")]
    save_ratio = median(save_s["with"]) / median(save_s["without"])
    load_ratio = median(load_s["with"]) / median(load_s["without"])
    rows.append(["ratio with / without", f"**{save_ratio:.3f}** (target <= 1.05)", "",
                 f"**{load_ratio:.3f}** (target <= 1.05)", ""])
    rows.append(["checksums alone: write / verify", f"{alone_write * 1e3:.1f}", "", f"{alone_verify * 1e3:.1f}", ""])
    table(f"Benchmark 8: checksums, llama {args.flavor} ({size / 2**20:.1f} MiB per checkpoint), {repeats} saves each",
          ["checksums", "save ms (median)", "save min..max", "load ms (median)", "load min..max"], rows)


if __name__ == "__main__":
    main()
