"""The layout a checkpoint was saved with, and the line that names another one at a resume."""

from __future__ import annotations

import re
from typing import Any

from torchtitan_rng.integrations.torchtitan.streams import STREAMS_PART

# The parallel degrees of torchtitan's ParallelDims, in the order the layout is written.
_DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


def layout_of(parallel_dims: Any) -> dict[str, int]:
    """The resolved layout of a run: its process count and parallel degrees."""
    return {"world_size": parallel_dims.world_size, **{name: getattr(parallel_dims, name) for name in _DEGREES}}


def _processes(count: int) -> str:
    return f"{count} process{'es' if count != 1 else ''}"


def _ranks(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def describe_layout(world_size: int, layout: dict[str, int] | None) -> str:
    """``2 processes (dp_shard 2)``; the degrees that are not 1, or why there are none to name."""
    if layout is None:
        return f"{_processes(world_size)} (layout not recorded)"
    degrees = " x ".join(f"{name} {layout[name]}" for name in _DEGREES if layout.get(name, 1) != 1)
    return f"{_processes(world_size)} ({degrees or 'no parallelism'})"


def layout_change(saved_world: int, saved_layout: dict[str, int] | None, world: int,
                  layout: dict[str, int]) -> str | None:
    """The WARNING line for a resume on another process count or layout, None when both are the same.
    ``saved_world`` counts the ranks whose streams the checkpoint holds; ``saved_layout`` comes from its run
    record (None for a checkpoint saved before the layout was recorded: then only the counts are compared).

    The rule: rank r restores the streams rank r saved, where the checkpoint has them (a stream continues
    rather than replaying the draws of step 1); a rank the checkpoint lacks keeps the streams torchtitan seeded
    at start (from ``debug.seed``), as in a fresh run. Never one rank's streams onto another rank."""
    def degrees(of: dict[str, int] | None) -> dict[str, int] | None:
        return None if of is None else {name: of.get(name, 1) for name in _DEGREES}

    if saved_world == world and (saved_layout is None or degrees(saved_layout) == degrees(layout)):
        return None
    if world <= saved_world:
        rule = f"{_ranks(0, world - 1)} restore{'s' if world == 1 else ''} the streams saved by the rank of the " \
               "same number"
        if world < saved_world:
            rule += f"; the streams saved by {_ranks(world, saved_world - 1)} are not used"
    else:
        new = world - saved_world
        rule = (f"{_ranks(0, saved_world - 1)} restore{'s' if saved_world == 1 else ''} the streams saved by the "
                f"rank of the same number; {_ranks(saved_world, world - 1)}, new, keep{'s' if new == 1 else ''} "
                "the streams torchtitan seeded at start, as in a fresh run")
    return (f"torchtitan_rng: the checkpoint was saved by {describe_layout(saved_world, saved_layout)} and this run "
            f"has {describe_layout(world, layout)}: {rule}; this resume is not exact")


def saved_stream_ranks(keys: Any) -> int:
    """How many ranks' streams a checkpoint holds (DCP keys ``torchtitan_rng.rank_{r}``)."""
    return sum(1 for key in keys if re.fullmatch(rf"{re.escape(STREAMS_PART)}\.rank_\d+", key))
