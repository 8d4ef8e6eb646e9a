"""The mode marker every plan checks: the checkpoint part that marks a world-size-invariant run, and the rule it
enforces at a resume (an invariant run continues only an invariant checkpoint of the same batch shape, an ordinary
run only an ordinary checkpoint)."""

from __future__ import annotations

from typing import Any

import torch

from torchtitan_rng.checkpoint.layout import CheckpointInfo
from torchtitan_rng.config import Training
from torchtitan_rng.errors import CheckpointError

RECORD_PART = "world_size_invariant"
_FLAG = "--parallelism.world_size_invariant"


def check_checkpoint_mode(info: CheckpointInfo, invariant: bool) -> None:
    saved = info.holds(RECORD_PART)
    if saved and not invariant:
        raise CheckpointError(f"checkpoint {info.path} was saved by a world-size-invariant run; resume it with "
                              f"{_FLAG} (and the same training.global_batch_size)")
    if invariant and not saved:
        raise CheckpointError(f"checkpoint {info.path} was not saved by a world-size-invariant run, so no process "
                              f"count can continue it bit for bit; resume it without {_FLAG}, with its own "
                              "process count")


class InvariantRecord:
    """A Stateful checkpoint part: the batch shape of the invariant run (its presence marks the mode)."""

    def __init__(self, training: Training) -> None:
        self.global_batch_size = training.global_batch_size
        self.local_batch_size = training.local_batch_size

    def state_dict(self) -> dict[str, Any]:
        return {"global_batch_size": torch.tensor(self.global_batch_size, dtype=torch.int64),
                "local_batch_size": torch.tensor(self.local_batch_size, dtype=torch.int64)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = int(state_dict["global_batch_size"]), int(state_dict["local_batch_size"])
        if saved != (self.global_batch_size, self.local_batch_size):
            raise CheckpointError(
                f"the checkpoint's invariant run had training.global_batch_size = {saved[0]} and "
                f"training.local_batch_size = {saved[1]}, this run {self.global_batch_size} and "
                f"{self.local_batch_size}; pass --training.global_batch_size {saved[0]} "
                f"--training.local_batch_size {saved[1]} to continue it bit for bit"
            )
