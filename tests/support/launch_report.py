"""The launch record summed up: ``python -m tests.support.launch_report FILE`` (the JSONL that
``TORCHTITAN_RNG_LAUNCH_RECORD`` names, one line per launch of tests/support/launch.py)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def main(path: str) -> None:
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    launches = [line for line in lines if "run_s" in line]
    forked = [line for line in lines if "cpu_s" in line]  # zygote.py: each forked process, ranks included
    kinds: dict[tuple[int, bool], list[float]] = defaultdict(list)
    files: dict[str, list[float]] = defaultdict(list)
    for launch in launches:
        kinds[(launch["processes"], launch["warm"])].append(launch["run_s"])
        files[launch["test"].split("::")[0]].append(launch["run_s"])
    print(f"{len(launches)} launches, {sum(sum(v) for v in kinds.values()):.0f} s running, "
          f"{sum(launch['wait_s'] for launch in launches):.0f} s waiting for cores")
    print("processes  start  launches  seconds  median")
    for (processes, warm), seconds in sorted(kinds.items()):
        print(f"{processes:9}  {'warm' if warm else 'cold':5}  {len(seconds):8}  {sum(seconds):7.0f}  "
              f"{sorted(seconds)[len(seconds) // 2]:6.2f}")
    print("files by seconds of launches:")
    for name, seconds in sorted(files.items(), key=lambda item: -sum(item[1]))[:20]:
        print(f"  {sum(seconds):6.0f} s  {len(seconds):3} launches  {name}")
    cpu: dict[str, list[float]] = defaultdict(list)
    for process in forked:
        cpu[process["test"].split("::")[0]].append(process["cpu_s"])
    print(f"CPU seconds of the {len(forked)} forked processes (ranks included), "
          f"{sum(map(sum, cpu.values())):.0f} s in all; by file:")
    for name, seconds in sorted(cpu.items(), key=lambda item: -sum(item[1]))[:20]:
        print(f"  {sum(seconds):6.0f} s  {len(seconds):3} processes  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
