"""The save-time check that the ranks which must draw the same dropout masks hold the same mask streams.

torchtitan seeds every rank of a pipeline stage alike (``debug.seed``, or rank 0's random seed). The ranks of a
tensor-parallel group draw a dropout in a region they replicate together; the ranks of a context-parallel group
draw the masks of one sequence, each its own slice, from the same point of the stream; the replicas of HSDP's
replicate dimension draw as each other. A rank whose streams have moved apart from its group's draws other
masks: the check names it. (The ranks of a data-parallel shard group draw alike too, on other data: nothing
has to agree there.)"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger

from torchtitan_rng.rng import capture_global_rng, fingerprint

# The streams a group draws its dropout masks from: torch's CPU generator (DTensor's random ops on a CPU mesh)
# and the accelerator's (which DTensor's random ops offset). Python's and NumPy's streams do not draw masks.
MASK_STREAMS = ("torch_cpu", "device")
# torchtitan's mesh dimension -> the group's name in the lines.
MASK_GROUPS = {"tp": "tensor-parallel", "cp": "context-parallel", "dp_replicate": "replicate (HSDP)"}


def mask_group_mismatch(step: int, group: str, ranks: list[int], streams: list[dict[str, str]]) -> str | None:
    """The WARNING line when the ranks of one ``group`` (its name, e.g. ``tensor-parallel``; ``ranks``, with the
    fingerprints of their ``MASK_STREAMS``) hold different mask streams at a save; None when they are the same."""
    differing = [name for name in MASK_STREAMS if len({rank_streams[name] for rank_streams in streams}) > 1]
    if not differing:
        return None
    holders = "; ".join(f"rank {rank}: " + ", ".join(rank_streams[name] for name in differing)
                        for rank, rank_streams in zip(ranks, streams))
    return (f"torchtitan_rng: at step {step} the ranks of a {group} group hold different "
            f"{' and '.join(differing)} random streams ({holders}): they no longer draw the same dropout masks; "
            "each rank's streams are saved as they are, so the resume stays exact")


def mask_groups(parallel_dims: Any) -> list[tuple[str, dist.ProcessGroup]]:
    """This rank's groups that must draw alike (``MASK_GROUPS`` whose degree is above 1), the same order on
    every rank: each check is a collective."""
    meshes = ((name, parallel_dims.get_optional_mesh(dim)) for dim, name in MASK_GROUPS.items())
    return [(name, mesh.get_group()) for name, mesh in meshes if mesh is not None]


def check_mask_groups(step: int, groups: list[tuple[str, dist.ProcessGroup]], device: torch.device) -> None:
    """At a save, every rank: compare each group's mask streams (one gather of their fingerprints per group);
    the group's first rank says they are equal, or names the difference."""
    if not groups:
        return
    state = capture_global_rng(device)
    mine = {name: fingerprint(state[name]) for name in MASK_STREAMS}
    rank = dist.get_rank()
    for name, group in groups:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        ranks = dist.get_process_group_ranks(group)
        if rank != ranks[0]:
            continue
        line = mask_group_mismatch(step, name, ranks, gathered)
        if line is not None:
            logger.warning(line)
        else:
            logger.info(f"torchtitan_rng: step {step}: the mask streams of {name} ranks "
                        f"{', '.join(map(str, ranks))} are equal")
