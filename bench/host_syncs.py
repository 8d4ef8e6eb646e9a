"""Benchmark 9: host synchronisations per training step, and step time with every resume feature on vs off.

A host sync is a read of a tensor's value on the host (``.item()``, ``float()``, ``int()``, ``bool()``,
``.tolist()``): on an accelerator it waits for all queued device work. The benchmark wraps those methods in
the training process and counts the calls during a run of S steps and of 3S steps; the difference over 2S
steps is the count per step, start-up excluded. Reads made by the trainer's own code (torchtitan_rng) are
counted apart from those of its data pipeline (the sampler and datasets, which read host tensors: never a
device sync) and those inside torch (e.g. the optimizer reading its step counter, a host tensor on an
accelerator too). On CPU a read costs little; the trainer's count is what an accelerator would pay. On
CUDA the last column counts the device synchronisations themselves, as torch's sync debug mode reports
them (every read of a device tensor, from any code).

The step time with those features on vs off is benchmark 1 (``bench.step_time``).

    python -m bench.host_syncs [--workers N]
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import warnings
from typing import Any, Callable, Iterator

import torch

from bench.common import parser, table
from torchtitan_rng import device as device_lib
from bench.step_time import run_debug_training

_READS = ("item", "tolist", "__float__", "__int__", "__bool__")


def _reader(module: str) -> str:
    if not module.startswith("torchtitan_rng"):
        return "torch"
    return "data" if module.startswith("torchtitan_rng.data") or module.endswith(".dataset") else "trainer"


@contextlib.contextmanager
def counting_reads() -> Iterator[dict[str, int]]:
    """Counts host reads of tensor values while open, by the calling module:
    ``{"trainer": n, "data": m, "torch": k}``."""
    counts = {"trainer": 0, "data": 0, "torch": 0}
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def counted(original: Callable[..., Any]) -> Callable[..., Any]:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts[_reader(sys._getframe(1).f_globals.get("__name__", ""))] += 1
            return original(self, *args, **kwargs)
        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@contextlib.contextmanager
def counting_device_syncs() -> Iterator[dict[str, int]]:
    """``{"device": n}``: synchronising device operations while open, where the accelerator's sync debug mode
    reports them (CUDA: one warning each); ``{}`` elsewhere."""
    set_mode = getattr(device_lib.device_module, "set_sync_debug_mode", None)
    if set_mode is None:
        yield {}
        return
    counts = {"device": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_mode("warn")
        try:
            yield counts
        finally:
            set_mode("default")
            counts["device"] = sum("synchronizing" in str(warning.message) for warning in caught)


def reads_in_run(steps: int, log_freq: int, common: list[str], dump: str) -> dict[str, int]:
    with counting_reads() as counts, counting_device_syncs() as syncs:
        run_debug_training(common, steps, log_freq, dump)
    return {**counts, **syncs}


def main() -> None:
    args = parser(__doc__.splitlines()[0], workers=True)
    args = args.parse_args()
    common = ["--data.num_workers", str(args.workers)]
    sync_rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for freq in (1, 10):
            short = reads_in_run(10, freq, common, f"{scratch}/short{freq}")
            long = reads_in_run(30, freq, common, f"{scratch}/long{freq}")
            per_step = {key: (long[key] - short[key]) / 20 for key in long}
            sync_rows.append([str(freq), f"**{per_step['trainer']:.2f}**", f"{per_step['data']:.2f}",
                              f"{per_step['torch']:.2f}",
                              f"**{per_step['device']:.2f}**" if "device" in per_step else "n/a (no accelerator)"])
    table(f"Benchmark 9: host reads of tensor values per training step (llama debug, {args.workers} workers)",
          ["metrics.log_freq", "reads by the trainer / step", "reads of host tensors by the data pipeline / step",
           "reads inside torch / step", "device syncs / step (sync debug mode)"], sync_rows)


if __name__ == "__main__":
    main()
