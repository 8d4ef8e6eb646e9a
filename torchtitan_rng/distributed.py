"""Process group, data-parallel mesh and clean teardown."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from torchtitan_rng import device as device_lib
from torchtitan_rng.config import ConfigError, Parallelism


@dataclass
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: Any = None  # the data-parallel DeviceMesh when world_size > 1


def init_distributed(parallelism: Parallelism) -> World:
    """Join torchrun's process group when there is one; plain ``python train.py`` runs alone."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    data_parallel_degree(parallelism, world_size)
    problem = device_lib.too_many_processes(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if problem is not None:
        raise ConfigError(problem)
    device = device_lib.device_for_rank(local_rank)
    mesh = None
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        backend = device_lib.distributed_backend()
        # gloo as well, for CPU-side collectives (async checkpoint staging, barriers) on accelerators.
        backend_spec = backend if backend == "gloo" else f"cpu:gloo,{device.type}:{backend}"
        timeout = timedelta(minutes=10)
        store = _restart_store(timeout)
        if store is None:
            dist.init_process_group(backend=backend_spec, timeout=timeout)
        else:
            dist.init_process_group(backend=backend_spec, timeout=timeout, store=store, rank=rank,
                                    world_size=world_size)
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp_shard",))
    return World(rank=rank, world_size=world_size, local_rank=local_rank, device=device, mesh=mesh)


def data_parallel_degree(parallelism: Parallelism, world_size: int) -> int:
    """The processes that shard each stage of the model (FSDP2), with torchtitan's meaning of the degrees: their
    product is the process count, ``data_parallel_shard_degree x tensor_parallel_degree x pipeline_parallel_degree
    = world``, and a shard degree of -1 fills what the other two leave (``world / (tp x pp)``)."""
    pp, tp, degree = (parallelism.pipeline_parallel_degree, parallelism.tensor_parallel_degree,
                      parallelism.data_parallel_shard_degree)
    if pp < 1:
        raise ConfigError(f"config parallelism.pipeline_parallel_degree = {pp}; give 1 (no stages) or more")
    if tp < 1:
        raise ConfigError(f"config parallelism.tensor_parallel_degree = {tp}; give 1 (no split) or more")
    others = " x ".join(name for name, value in (("tensor_parallel_degree", tp), ("pipeline_parallel_degree", pp))
                        if value > 1) or "pipeline_parallel_degree"
    if degree == -1:
        if world_size % (pp * tp):
            raise ConfigError(f"config parallelism.{others} = {pp * tp} does not divide the {world_size} processes "
                              f"started; start a multiple of it ({'tp x ' if tp > 1 else ''}pp x dp processes)")
        return world_size // (pp * tp)
    if degree < 1 or degree * pp * tp != world_size:
        raise ConfigError(f"config parallelism.data_parallel_shard_degree = {degree} x {others} = {pp * tp} is "
                          f"{degree * pp * tp} processes, but {world_size} were started; use -1 (the processes the "
                          f"other degrees leave) or start {max(degree, 1) * pp * tp} (NGPU)")
    return degree


def _restart_store(timeout: timedelta) -> dist.Store | None:
    """After a torchrun restart (``--max-restarts``), torchrun's store for this attempt's process groups.

    The restarted ranks share torchrun's store with the attempt before them, whose ranks left their gloo
    addresses in it under the same keys: read, those would make the new ranks connect to processes that are
    gone until the timeout. A prefix of the attempt keeps each attempt's keys apart. None on a first
    attempt, or when torchrun hosts no store for its ranks."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"torchtitan_rng/attempt_{attempt}", store)


def rank_and_world_size() -> tuple[int, int]:
    """This process's rank and the world size of the initialised process group; (0, 1) without one."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def mean_over_ranks(value: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The mean of a scalar over the ranks of ``group`` (None: all ranks; the logged loss)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value.detach().clone()
    total = value.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total / dist.get_world_size(group)


def all_ranks_agree_any(flag: bool, device: torch.device) -> bool:
    """True on every rank when it is True on at least one (used for stop requests)."""
    if not dist.is_initialized():
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


class StopVote:
    """Agree on a stop request at a step boundary without waiting on the device.

    Each :meth:`poll` starts an all-reduce of this rank's flag on a CPU (gloo) group and returns the result of
    the one started at the previous poll, finished by then unless a rank is more than a step behind (which
    data-parallel training, synchronised by its gradients, never is): all ranks read the same vote at the
    same boundary, so all stop at the same step, one step after the first of them got the signal. Alone, it
    returns the flag itself. The vote lives on a CPU tensor, so reading it never waits for queued device
    work (an all-reduce of a device tensor, read on the host, would at every step).
    """

    def __init__(self) -> None:
        self.pending: tuple[Any, torch.Tensor] | None = None
        # Its own group: a vote waiting for a slower rank holds none of the training group's gloo threads.
        self.group = dist.new_group(backend="gloo") if rank_and_world_size()[1] > 1 else None

    def poll(self, flag: bool) -> bool:
        """Cast this rank's flag; True on every rank when any rank's flag was set at the previous poll (a
        collective: every rank polls at the same boundaries)."""
        if self.group is None:
            return flag
        agreed = self.close()
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self.pending = (dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group, async_op=True), value)
        return agreed

    def close(self) -> bool:
        """Wait for the vote in flight (before the process group goes) and return it; False when none is."""
        if self.pending is None:
            return False
        work, value = self.pending
        self.pending = None
        work.wait()
        return bool(value.item())


def on_rank_zero(check: Callable[[], object], elsewhere: Exception, device: torch.device,
                 refusals: tuple[type[Exception], ...]) -> None:
    """Run ``check`` on rank 0 only (e.g. reading every byte of a checkpoint once); when it raises one of
    ``refusals``, every rank raises: rank 0 its own error, the others ``elsewhere``."""
    refused: Exception | None = None
    if rank_and_world_size()[0] == 0:
        try:
            check()
        except refusals as err:
            refused = err
    if all_ranks_agree_any(refused is not None, device):
        raise refused or elsewhere


def teardown(*, clean: bool = True) -> None:
    """Destroy the group; close dataloader iterators first (docs/design.md, "Teardown order"). A clean end
    waits for every rank first; after a failure another rank may be gone, so it does not wait."""
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
