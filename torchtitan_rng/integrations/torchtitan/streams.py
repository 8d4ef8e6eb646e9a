"""Where each rank's training streams live in a checkpoint, and the two places the loop meets them: the restore
after ``iter(dataloader)`` and validation under preserved streams."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from torchtitan_rng.rng import preserved_global_rng

# The checkpoint part holding every rank's streams (DCP keys ``torchtitan_rng.rank_{r}``).
STREAMS_PART = "torchtitan_rng"


class _RestoreAfterIter:
    """The trainer's dataloader as the training loop sees it: ``iter()`` creates the loader's iterator,
    then puts back the loaded streams (the step boundary, nothing of the resumed step has drawn yet)."""

    def __init__(self, loader: Any, restore: Callable[[], None]) -> None:
        self._loader = loader
        self._restore = restore

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self._loader)
        self._restore()
        return iterator

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _PreservedStreamsValidator:
    """The trainer's validator, whose ``validate`` leaves every training stream where it found it."""

    def __init__(self, validator: Any, device: torch.device) -> None:
        self._validator = validator
        self._device = device

    def validate(self, *args: Any, **kwargs: Any) -> Any:
        with preserved_global_rng(self._device):
            return self._validator.validate(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._validator, name)
