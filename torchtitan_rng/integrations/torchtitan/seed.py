"""The run's seed: torchtitan 0.3 seeds a run without ``--debug.seed`` at random (rank 0's torch generator's own
seed, broadcast to every rank), so no other run starts where it did."""

from __future__ import annotations


def unseeded_run(seed: int | None) -> str | None:
    """The WARNING line for a run without ``--debug.seed``; None for a seeded run."""
    if seed is not None:
        return None
    return ("torchtitan_rng: --debug.seed is not set, so torchtitan seeds this run at random: its checkpoints and "
            "losses cannot be compared with another run's (an uninterrupted control draws other random numbers "
            "from step 1); pass --debug.seed N to every run you mean to compare")
