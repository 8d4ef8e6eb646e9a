"""The host copy an async checkpoint writes from, taken at the step boundary.

Ours rather than DCP's ``DefaultStager``: that one deep-copies every value, and in torch 2.11 its copy
fails on the ``bytes`` values that hold our per-rank state (``KeyError: <class 'type'>``). Here tensors
are copied into host buffers that are kept between saves (the previous write has finished before the
next save stages), and every other value — numbers, strings, bytes — is immutable and passes through.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor


class HostCopyStager(AsyncStager):
    _synchronize_after_execute = False  # stage() has finished copying when it returns

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return self._copy(state_dict, ())

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._buffers.clear()

    def _copy(self, value: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(value, DTensor):
            local = self._host_copy(value.to_local(), path)
            return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                      shape=value.shape, stride=value.stride())
        if isinstance(value, torch.Tensor):
            return self._host_copy(value, path)
        if isinstance(value, dict):
            return {key: self._copy(item, path + (key,)) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(item, path + (index,)) for index, item in enumerate(value))
        return value

    def _host_copy(self, tensor: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._buffers[path] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        buffer.copy_(tensor.detach())
        return buffer
