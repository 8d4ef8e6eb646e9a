"""Benchmark 7: checkpoint write throughput vs. the disk's raw write throughput, measured in the same run.

Raw: one file of the checkpoint's size written in 64 MiB chunks and fsynced (DCP fsyncs its files too).
Checkpoint: a synchronous full save (model, optimizer, RNG, dataloader, train state) of the same run.
Both go to the same folder, alternating, and each is measured from the start of the write until the data
is on disk.

    python -m bench.write_throughput [--quick] [--flavor small]
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from bench.common import build_run, config_for, folder_bytes, median, parser, scratch_parent, spread, table, timed
from torchtitan_rng.checkpoint.layout import step_dir
from torchtitan_rng.checkpoint.manager import CheckpointManager

CHUNK = 64 * 2**20


def raw_write(path: Path, size: int) -> float:
    """Seconds to write ``size`` bytes to ``path`` and fsync them."""
    chunk = os.urandom(min(CHUNK, size))  # not zeros: no filesystem may shortcut them
    start = time.perf_counter()
    with path.open("wb") as file:
        written = 0
        while written < size:
            written += file.write(chunk[: size - written])
        file.flush()
        os.fsync(file.fileno())
    return time.perf_counter() - start


def main() -> None:
    args = parser(__doc__.splitlines()[0])
    args.add_argument("--flavor", default="small", help="llama flavor (default small; bench for ~1 GB)")
    args = args.parse_args()
    repeats = 3 if args.quick else 8
    run = build_run(config_for("--model.flavor", args.flavor))
    raw_mbs, checkpoint_mbs = [], []
    with tempfile.TemporaryDirectory(dir=scratch_parent()) as scratch:
        manager = CheckpointManager(Path(scratch) / "checkpoint", run.parts, interval=1)
        for index in range(repeats):
            seconds = timed(lambda: manager.save(index))
            size = folder_bytes(step_dir(manager.folder, index))
            shutil.rmtree(step_dir(manager.folder, index))
            checkpoint_mbs.append(size / seconds / 1e6)
            raw_file = Path(scratch) / "raw.bin"
            raw_mbs.append(size / raw_write(raw_file, size) / 1e6)
            raw_file.unlink()
    ratio = median(checkpoint_mbs) / median(raw_mbs)
    table(
        f"Benchmark 7: write throughput, checkpoint vs raw disk (llama {args.flavor}, {size / 2**20:.1f} MiB, "
        f"{repeats} writes each, {scratch_parent()})",
        ["write", "MB/s (median)", "min..max"],
        [["raw (write + fsync)", f"{median(raw_mbs):.0f}", spread(raw_mbs)],
         ["checkpoint (DCP save)", f"{median(checkpoint_mbs):.0f}", spread(checkpoint_mbs)],
         ["checkpoint / raw", f"**{ratio:.2f}**", ""]],
    )


if __name__ == "__main__":
    main()
