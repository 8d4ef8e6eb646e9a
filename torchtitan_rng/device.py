"""The one place that knows which accelerator exists.

Everything else asks for ``device_type`` / ``device_module`` / ``device_for_rank`` and never names
cuda, xpu or mps itself.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import torch


def _resolve_device_type() -> str:
    # TORCHTITAN_RNG_DEVICE=cpu lets a user (or a test) keep a run on the CPU on a GPU machine.
    forced = os.environ.get("TORCHTITAN_RNG_DEVICE")
    if forced:
        return forced
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator().type
    return "cpu"


device_type: str = _resolve_device_type()
# For "cpu" there is no separate device generator: the CPU generator is the device generator.
device_module: ModuleType | None = None if device_type == "cpu" else getattr(torch, device_type)


def device_for_rank(local_rank: int) -> torch.device:
    """The device this process trains on; sets it as current where the accelerator has that notion."""
    if device_module is None:
        return torch.device("cpu")
    count = device_module.device_count()
    index = local_rank % count if count else 0
    if hasattr(device_module, "set_device"):
        device_module.set_device(index)
    return torch.device(device_type, index)


def too_many_processes(local_world_size: int) -> str | None:
    """Why ``local_world_size`` processes on this node cannot each have an accelerator of their own, or None.

    NCCL and XCCL refuse two ranks on one device (with a traceback, at the first collective).
    """
    if device_type not in ("cuda", "xpu") or device_module is None:
        return None
    count = device_module.device_count()
    if local_world_size <= count:
        return None
    return (f"{local_world_size} processes on this node but {count} {device_type} device(s): each process needs a "
            f"device of its own; start at most {count} (NGPU={count})")


def distributed_backend() -> str:
    """The collective backend for this device type (gloo on the CPU)."""
    return {"cuda": "nccl", "xpu": "xccl"}.get(device_type, "gloo")


def seed_generators(value: int) -> None:
    """Seed torch's CPU generator and this accelerator's generators (every device's, as ``torch.manual_seed``
    seeds them) with ``value``. ``torch.manual_seed`` also queues a lazy seeding for each accelerator torch was
    built for and the machine lacks, each with a stack trace: ~250 us a call on a CPU-only machine, against
    ~2 us for the CPU generator alone, and the world-size-invariant mode seeds before every block."""
    torch.default_generator.manual_seed(value)
    if device_module is not None:
        # MPS has one device and no manual_seed_all.
        getattr(device_module, "manual_seed_all", device_module.manual_seed)(value)


def get_device_rng_state(device: torch.device) -> torch.Tensor | None:
    """This rank's accelerator generator state, or None on the CPU (covered by the CPU generator)."""
    if device_module is None:
        return None
    return device_module.get_rng_state(device).clone()


def set_device_rng_state(state: torch.Tensor, device: torch.device) -> None:
    assert device_module is not None, "no device generator on the CPU"
    device_module.set_rng_state(state, device)


def prepare_dtensor_random(mesh: Any) -> None:
    """DTensor's random ops on an accelerator mesh: its offset-based tracker, created now without the broadcast
    of rank 0's generator state it does when it creates itself at the first random op (which would give every
    data shard rank 0's stream). It keeps no state of its own: the device generator holds it. On the CPU DTensor
    has no tracker; its random ops draw from each rank's own CPU generator."""
    if device_module is None:
        return
    from torch.distributed.tensor import _random

    if _random._rng_tracker is None:
        _random._rng_tracker = _random.OffsetBasedRNGTracker(mesh, run_state_sync=False)


def memory_allocated_bytes(device: torch.device) -> int:
    """Accelerator memory in use, 0 on the CPU (reported in progress lines)."""
    if device_module is None or not hasattr(device_module, "memory_allocated"):
        return 0
    return int(device_module.memory_allocated(device))


def use_deterministic_algorithms() -> None:
    """torch's deterministic kernels; cuBLAS needs a fixed workspace for that (set before first use)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
