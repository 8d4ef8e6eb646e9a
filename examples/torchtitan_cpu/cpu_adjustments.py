"""torchtitan 0.3 on a CPU (gloo, FSDP2): what its stock code needs to train where there is no accelerator.

None of this is part of the plug-in (``torchtitan_rng.integrations.torchtitan``), which runs unchanged on an
accelerator; each adjustment says why a CPU needs it. ``apply()`` must run before anything imports torchtitan
(``train.py`` here calls it first).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

_MOE_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def stub_moe_kernels() -> None:
    """Lets torchtitan's models import without Triton (applying nothing else)."""
    # torchtitan's MoE token dispatcher imports its Triton kernels unconditionally, and there is no Triton
    # for the CPU. An inert module in their place lets the import pass (the dense model never calls them);
    # a fake ``triton`` instead would make torch believe Triton is installed.
    stub = types.ModuleType(_MOE_KERNELS)
    for name in ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
                 "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
                 "reduce_topk_slots_kernel", "topk_scores_grad_kernel"):
        setattr(stub, name, None)
    sys.modules.setdefault(_MOE_KERNELS, stub)


class _CpuDeviceModule(types.ModuleType):
    """torch.cpu, plus the device-name and memory-statistics calls of torchtitan's metrics (no-ops)."""

    def __init__(self) -> None:
        super().__init__("torch_cpu_for_torchtitan")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        return types.SimpleNamespace(name="cpu", total_memory=1 << 30)

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


_applied = False


def apply() -> None:
    """Every adjustment, once per process (a process forked from one that applied them may apply them again)."""
    global _applied
    if _applied:
        return
    _applied = True
    stub_moe_kernels()
    import torch.distributed as dist

    from torchtitan.tools import utils

    # torchtitan's device helpers fall back to "cuda" when no accelerator is found (tools/utils.py), and
    # torch.cpu lacks the memory-monitor functions its metrics call. Set before any other torchtitan
    # module copies them (``from torchtitan.tools.utils import device_module``).
    utils.device_type, utils.device_module = "cpu", _CpuDeviceModule()

    # Stock torchtitan 0.3.0 calls torch.distributed.set_timeout, which torch 2.13 lacks, after its first
    # step, and runs pipeline parallelism with torch 2.14's pre-split schedule.step. The plug-in provides both
    # when it is imported; a run without it (stock torchtitan, to compare with) needs them too.
    from torchtitan_rng.integrations.torchtitan import provide_presplit_step, provide_set_timeout

    provide_set_timeout()
    provide_presplit_step()

    # set_pg_timeouts calls barrier(device_ids=[current device]); gloo takes no device ids.
    barrier = dist.barrier

    def cpu_barrier(*args: Any, device_ids: Any = None, **kwargs: Any) -> Any:
        return barrier(*args, **kwargs)

    dist.barrier = cpu_barrier

    # torchtitan's FSDP2 reduce-scatters gradients with PREMUL_SUM(1 / 1.0) (the loss is already divided by
    # the global token count), and gloo has no PREMUL_SUM: with a factor of 1.0 it is a plain SUM.
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    divide_factors = _fsdp_collectives._get_gradient_divide_factors

    def plain_sum_for_unit_factor(*args: Any, **kwargs: Any) -> Any:
        factor = kwargs.get("factor", args[4] if len(args) > 4 else None)
        if factor == 1.0:
            return None, None, dist.ReduceOp.SUM, dist.ReduceOp.SUM
        return divide_factors(*args, **kwargs)

    _fsdp_collectives._get_gradient_divide_factors = plain_sum_for_unit_factor

    # The block mask is built by a torch.compile'd create_block_mask: compiling it with inductor on the CPU
    # takes minutes on a small machine. Eager builds the same mask.
    from torch.nn.attention.flex_attention import create_block_mask

    from torchtitan.models.common import attention

    attention._compiled_create_block_mask = create_block_mask
