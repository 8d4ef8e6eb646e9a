"""The end of a rank that a test spawns with torch.multiprocessing."""

from __future__ import annotations

from typing import NoReturn

import torch.distributed as dist

from torchtitan_rng.train import exit_now


def end_rank() -> NoReturn:
    """A spawned rank's last line: destroy its group, then exit 0 without interpreter finalization, as the
    trainer does (``exit_now`` says why: a mesh or DTensor the rank still holds keeps gloo threads that can
    abort the process after its work is done, "terminate called without an active exception")."""
    dist.destroy_process_group()
    exit_now(0)
