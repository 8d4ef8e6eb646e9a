"""The save-time check that the ranks which must draw the same dropout masks hold the same mask streams.

torchtitan seeds every rank of a pipeline stage alike (``debug.seed``, or rank 0's random seed). The ranks of a
tensor-parallel group draw a dropout in a region they replicate together; the ranks of a context-parallel group
draw the masks of one sequence, each its own slice, from the same point of the stream; the replicas of HSDP's
replicate dimension draw as each other. A rank whose streams have moved apart from its group's draws other
masks: the check names it (``rng.group_mask_streams``). The ranks of a data-parallel shard group draw alike too,
on other data: nothing has to agree there."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger

from torchtitan_rng.rng import group_mask_streams

# torchtitan's mesh dimension -> the kind of group (``rng.MASK_GROUPS``) its groups are.
MESH_GROUPS = {"tp": "tensor-parallel", "cp": "context-parallel", "dp_replicate": "replicate (HSDP)"}


def mask_groups(parallel_dims: Any) -> list[tuple[str, dist.ProcessGroup]]:
    """This rank's groups that must draw alike (``MESH_GROUPS`` whose degree is above 1), in the same order on
    every rank: each check is a collective."""
    meshes = ((kind, parallel_dims.get_optional_mesh(dim)) for dim, kind in MESH_GROUPS.items())
    return [(kind, mesh.get_group()) for kind, mesh in meshes if mesh is not None]


def check_mask_groups(step: int, groups: list[tuple[str, dist.ProcessGroup]], device: torch.device) -> None:
    """At a save, every rank: compare each group's mask streams (one gather of their fingerprints per group);
    the group's first rank says they are equal, or names the difference."""
    rank = dist.get_rank() if groups else 0
    for kind, group in groups:
        ranks, line = group_mask_streams(step, group, device, kind)
        if rank != ranks[0]:
            continue
        if line is not None:
            logger.warning(f"torchtitan_rng: {line}")
        else:
            logger.info(f"torchtitan_rng: step {step}: the mask streams of {kind} ranks "
                        f"{', '.join(map(str, ranks))} are equal")
