"""TrainState: the step and this rank's random streams, as a DCP Stateful.

Per-rank values live under rank-unique keys (``rank_{r}``): DCP keeps only one copy of a same-key
non-DTensor value saved from every rank, so a shared key would hand every rank rank 0's RNG on load.
"""

from __future__ import annotations

from typing import Any

import torch

from torchtitan_rng.checkpoint.codec import decode_state, encode_state
from torchtitan_rng.checkpoint.layout import rank_key
from torchtitan_rng.distributed import rank_and_world_size
from torchtitan_rng.errors import CheckpointError
from torchtitan_rng.rng import capture_global_rng, group_mask_streams, restore_global_rng

STATE_FORMAT = 1


class TrainState:
    """``state_dict()`` captures the global streams at the moment it is called: call it (or save) at a
    step boundary. ``load_state_dict()`` only remembers them; :meth:`restore_rng` puts them back and
    belongs right before the first resumed step, after everything that runs once at start-up.

    ``rank`` and ``world_size`` default to those of the initialised process group (0 and 1 without one),
    so that no rank saves under another rank's key. ``tensor_group``: the ranks of this rank's tensor-parallel group
    (None: none), whose mask streams must agree: compared at each save, a difference named in one WARNING line."""

    def __init__(self, device: torch.device, rank: int | None = None, world_size: int | None = None,
                 tensor_group: Any = None) -> None:
        group_rank, group_world = rank_and_world_size()
        self.device = device
        self.tensor_group = tensor_group
        self.rank = group_rank if rank is None else rank
        self.world_size = group_world if world_size is None else world_size
        self.step = 0
        # What was loaded for this rank: {"rng", "world_size", "device_type"}, or None.
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        if self.tensor_group is not None:
            ranks, line = group_mask_streams(self.step, self.tensor_group, self.device)
            if line is not None and self.rank == ranks[0]:
                print(f"WARNING: {line}", flush=True)
        rank_state = {
            "format": STATE_FORMAT,
            "world_size": self.world_size,
            "device_type": self.device.type,
            "rng": capture_global_rng(self.device),
        }
        return {"step": torch.tensor(self.step, dtype=torch.int64), rank_key(self.rank): encode_state(rank_state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        blob = state_dict.get(rank_key(self.rank))
        self.loaded = decode_state(blob) if blob is not None else None
        if self.loaded is not None and self.loaded.get("format", STATE_FORMAT) > STATE_FORMAT:
            raise CheckpointError(f"the checkpoint's train state of rank {self.rank} has format "
                                  f"{self.loaded['format']}, newer than this torchtitan_rng reads ({STATE_FORMAT}); "
                                  "resume it with the version that saved it")

    def restore_rng(self, *, include_device: bool = True) -> bool:
        """Restore the loaded streams of this rank; False when nothing was loaded."""
        if self.loaded is None:
            return False
        restore_global_rng(self.loaded["rng"], self.device, include_device=include_device)
        return True
