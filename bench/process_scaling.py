"""Benchmark 6: checkpoint save and load time vs. number of processes (1, 2, 4): how the cost grows.

Each process count is one torchrun launch (gloo on the CPU; on an accelerator only counts up to the number
of devices). Every process builds the same run (model sharded with FSDP2 over all of them), trains one
step, then saves and loads the full checkpoint several times; a save or load is timed on rank 0 from a
barrier before to a barrier after, so it is the time of the slowest rank.

    python -m bench.process_scaling [--quick] [--flavor small]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import REPO, build_run, config_for, median, parser, scratch_parent, spread, table, timed
from torchtitan_rng import device as device_lib
from torchtitan_rng.checkpoint.layout import step_dir
from torchtitan_rng.checkpoint.manager import CheckpointManager
from torchtitan_rng.distributed import barrier, init_distributed, teardown

RESULT = "bench-result: "


def worker(flavor: str, repeats: int, folder: str) -> None:
    """One rank of a launch: prints its timings on rank 0."""
    config = config_for("--model.flavor", flavor)
    world = init_distributed(config.parallelism)
    run = build_run(config, rank=world.rank, world_size=world.world_size, mesh=world.mesh)
    manager = CheckpointManager(Path(folder), run.parts, interval=1, rank=world.rank)
    saves, loads = [], []

    def collective(fn):  # barrier-to-barrier: the slowest rank's time
        barrier()
        return timed(lambda: (fn(), barrier()))

    for index in range(repeats):
        saves.append(collective(lambda: manager.save(index)))
    for index in range(repeats):
        loads.append(collective(lambda: manager.load(step_dir(manager.folder, index))))
    if world.rank == 0:
        print(RESULT + json.dumps({"save": saves, "load": loads}), flush=True)
    teardown()


def launch(nproc: int, flavor: str, repeats: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory(dir=scratch_parent()) as scratch:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", str(nproc), "-m", "bench.process_scaling", "--worker", "--flavor", flavor,
               "--repeats", str(repeats), "--folder", f"{scratch}/checkpoint"]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)), "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the {nproc}-process launch failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[0][len(RESULT):])


def main() -> None:
    args = parser(__doc__.splitlines()[0])
    args.add_argument("--flavor", default="small")
    args.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one rank of a launch
    args.add_argument("--repeats", type=int, default=0)
    args.add_argument("--folder", default="")
    args = args.parse_args()
    repeats = args.repeats or (3 if args.quick else 8)
    if args.worker:
        worker(args.flavor, repeats, args.folder)
        return
    counts = [1, 2, 4]
    if device_lib.device_module is not None:  # one process per device
        counts = [n for n in counts if n <= device_lib.device_module.device_count()]
    rows = []
    for nproc in counts:
        result = launch(nproc, args.flavor, repeats)
        rows.append([nproc, f"{median(result['save']) * 1e3:.0f}", spread([s * 1e3 for s in result["save"]]),
                     f"{median(result['load']) * 1e3:.0f}", spread([s * 1e3 for s in result["load"]])])
    table(f"Benchmark 6: full checkpoint save and load vs. processes (llama {args.flavor}, FSDP2 over all "
          f"processes, {repeats} saves and loads each)",
          ["processes", "save ms (median)", "save min..max", "load ms (median)", "load min..max"], rows)


if __name__ == "__main__":
    main()
