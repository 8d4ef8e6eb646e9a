"""Shared by the benchmarks: the machine they ran on, timing on the configured device, tables, and the
parts of a training run (the trainer's own builders) to checkpoint.

Run a benchmark from the repository root: ``python -m bench.NAME [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from torchtitan_rng import device as device_lib
from torchtitan_rng.checkpoint import layout
from torchtitan_rng.build import build_components
from torchtitan_rng.config import JobConfig, parse_args
from torchtitan_rng.distributed import World
from torchtitan_rng.launch.runs import run_training
from torchtitan_rng.rng import seed_training_streams

REPO = Path(__file__).resolve().parents[1]
DEBUG_CONFIG = REPO / "train_configs" / "llama_debug.toml"

# torchdata's deprecation notice and DCP's "no process group" notice would drown the tables.
warnings.filterwarnings("ignore")


def parser(description: str, *, workers: bool = False) -> argparse.ArgumentParser:
    """``--quick``, and with ``workers`` a ``--workers N`` for the dataloader (default 2)."""
    args = argparse.ArgumentParser(description=description)
    args.add_argument("--quick", action="store_true", help="fewer repetitions (about 2 minutes on 2 CPU cores)")
    if workers:
        args.add_argument("--workers", type=int, default=2, help="dataloader workers (default 2)")
    return args


def machine() -> str:
    """One line naming the machine: CPU, cores, memory, torch, and the accelerator when there is one."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        cpu = names[0] if names else cpu
    memory = ""
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        memory = f", {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB RAM"
    accelerator = "no accelerator (CPU)"
    module = device_lib.device_module
    if module is not None:
        name = module.get_device_name(0) if hasattr(module, "get_device_name") else device_lib.device_type
        accelerator = f"{device_lib.device_type}: {name}"
    return (f"machine: {cpu}, {os.cpu_count()} cores{memory}; {accelerator}; torch {torch.__version__}, "
            f"Python {platform.python_version()}, {platform.system()} {platform.release()}")


def synchronize() -> None:
    """Wait for queued device work, so that a timing covers it (nothing to wait for on the CPU)."""
    if device_lib.device_module is not None:
        device_lib.device_module.synchronize()


def timed(fn: Callable[[], Any]) -> float:
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> str:
    """min..max, to show how much a number moved between repetitions."""
    return f"{min(values):.4g}..{max(values):.4g}"


def table(title: str, headers: list[str], rows: list[list[Any]]) -> None:
    """A Markdown table (pasted as is into docs/performance.md), then the machine."""
    print(f"\n{title}\n")
    print("| " + " | ".join(headers) + " |")
    print("| " + " | ".join("---" for _ in headers) + " |")
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")
    print(f"\n{machine()}\n", flush=True)


def config_for(*overrides: str) -> JobConfig:
    return parse_args(["--job.config_file", str(DEBUG_CONFIG), *overrides])


@dataclass
class RunParts:
    """What a training run checkpoints, built with the trainer's own builders, after real training steps
    (so the optimizer holds its state and the dataloader has a position)."""

    config: JobConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    parts: dict[str, Any]

    @property
    def model_and_optimizer(self) -> dict[str, Any]:
        return {name: self.parts[name] for name in (layout.MODEL, layout.OPTIMIZER)}


def build_run(config: JobConfig, *, steps: int = 1) -> RunParts:
    """One process's run, built as the trainer builds it, after ``steps`` real training steps."""
    world = World(rank=0, world_size=1, local_rank=0, device=device_lib.device_for_rank(0))
    run = build_components(config, world)
    seed_training_streams(config.debug.seed, world.rank)
    batches = iter(run.dataloader)
    for step in range(1, steps + 1):
        run.optimizer.zero_grad(set_to_none=True)
        run.plan.forward_backward(run.model, run.params, batches, run.loss_fn, step)
        run.optimizer.step()
        run.lr_scheduler.step()
    run.train_state.step = steps
    return RunParts(config, run.model, run.optimizer, run.checkpoint_parts())


def folder_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def checkout_env() -> dict[str, str]:
    """PYTHONPATH for a run a benchmark starts: this checkout first, so that the run measures the code beside the
    benchmark, not the copy installed in the environment (an editable install may point at another checkout)."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def scratch_parent() -> str:
    """Where benchmarks write: the repository's outputs/ (on the disk checkpoints would go to; the system
    temp folder can be RAM-backed). TORCHTITAN_RNG_BENCH_DIR picks another place."""
    folder = Path(os.environ.get("TORCHTITAN_RNG_BENCH_DIR", REPO / "outputs" / "bench"))
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder)


_MS_PER_STEP = re.compile(r"\s([\d.]+) ms/step")
_MEMORY = re.compile(r"(?:peak rss|mem) ([\d.]+) GiB")


def launch_times(overrides: list[str], nproc: int, steps: int, log_freq: int) -> tuple[list[float], float]:
    """One launch of the trainer on the debug config: ms per step of each progress line after the first (start-up
    and the first step), and rank 0's memory at the last line."""
    with tempfile.TemporaryDirectory(dir=scratch_parent()) as dump:
        proc = run_training(DEBUG_CONFIG, ["--job.dump_folder", dump, "--training.steps", str(steps),
                                           "--metrics.log_freq", str(log_freq), *overrides], nproc=nproc,
                            env={"OMP_NUM_THREADS": "1", **checkout_env()})
    if proc.returncode != 0:
        raise SystemExit(f"the run {' '.join(overrides)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return [float(value) for value in _MS_PER_STEP.findall(proc.stdout)][1:], float(_MEMORY.findall(proc.stdout)[-1])
