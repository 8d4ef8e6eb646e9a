"""The save-time check that the ranks which must draw the same dropout masks hold the same mask streams."""

from __future__ import annotations

# The streams a tensor-parallel group draws its dropout masks from: torch's CPU generator (DTensor's random ops
# on a CPU mesh) and the accelerator's (which DTensor's random ops offset). Equal on every rank of the group while
# its ranks draw alike (torchtitan seeds them alike); Python's and NumPy's streams do not draw masks.
MASK_STREAMS = ("torch_cpu", "device")


def tensor_parallel_mismatch(step: int, ranks: list[int], streams: list[dict[str, str]]) -> str | None:
    """The WARNING line when the ranks of one tensor-parallel group (``ranks``, with the fingerprints of their
    ``MASK_STREAMS``) hold different mask streams at a save; None when they are the same."""
    differing = [name for name in MASK_STREAMS if len({rank_streams[name] for rank_streams in streams}) > 1]
    if not differing:
        return None
    holders = "; ".join(f"rank {rank}: " + ", ".join(rank_streams[name] for name in differing)
                        for rank, rank_streams in zip(ranks, streams))
    return (f"torchtitan_rng: at step {step} the ranks of a tensor-parallel group hold different "
            f"{' and '.join(differing)} random streams ({holders}): a dropout in a region they replicate draws "
            "another mask on each rank; each rank's streams are saved as they are, so the resume stays exact")
