"""Reading a checkpoint without running code, and checking it is whole before anything is loaded.

DCP's ``.metadata`` is a pickle that DCP reads with plain ``pickle.load``, and DCP's default planner
unpickles non-tensor items with ``weights_only=False``: both could run code from a crafted checkpoint.
Here ``.metadata`` goes through an unpickler that knows only DCP's metadata classes, and non-tensor items
through ``torch.load(weights_only=True)``. ``dcp_io.inspect_checkpoint`` reads ``.metadata`` once per resume;
the result is handed to the load, which does not read it again. Which reader a checkpoint gets, and that
read, are dcp_io.py's: nothing here knows where a checkpoint is stored.
"""

from __future__ import annotations

import enum
import io
import pickle
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from torchtitan_rng.errors import CheckpointError


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, accepting only plain data for non-tensor items: tensors, numbers, strings,
    bytes, lists, tuples and dicts."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as err:  # the unpickler's refusal, whatever its type
            raise CheckpointError(
                f"refusing to load checkpoint item {fqn!r}: it is not plain data ({type(err).__name__}); "
                "the checkpoint may be crafted to run code"
            ) from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # DCP's own helper

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _metadata_enum_member(cls: Any, name: Any) -> Any:
    """The one use of ``getattr`` in DCP metadata: an enum member by its name. Python 3.11.2 (Debian 12) and
    3.12+ pickle an enum member as ``getattr(cls, name)``, other versions as ``cls(value)``; both must load."""
    if not (isinstance(cls, type) and cls in _MetadataUnpickler.enums() and isinstance(name, str)
            and name in cls.__members__):
        raise pickle.UnpicklingError(f"getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}) is not "
                                     "part of DCP metadata")
    return cls.__members__[name]


class _MetadataUnpickler(pickle.Unpickler):
    """Accepts only the classes a DCP metadata file is made of, and ``getattr`` only as a member of one of
    their enums by name."""

    _METADATA_MODULE = "torch.distributed.checkpoint.metadata"  # plain dataclasses and enums only
    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("pathlib", "PosixPath"),
                ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}
    # Protocols 0-2 name the builtins module as Python 2 did; the default find_class maps it, ours sees it raw.
    _GETATTR = {("builtins", "getattr"), ("__builtin__", "getattr")}

    @classmethod
    def enums(cls) -> frozenset[type]:
        """Every enum class defined in DCP's metadata module."""
        module = sys.modules[cls._METADATA_MODULE]
        return frozenset(value for value in vars(module).values()
                         if isinstance(value, type) and issubclass(value, enum.Enum))

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if (module, name) in self._GETATTR:
            return _metadata_enum_member
        if module in ("torch", self._METADATA_MODULE):
            found = getattr(torch if module == "torch" else sys.modules[module], name, None)
            if isinstance(found, torch.dtype) or (module == self._METADATA_MODULE and isinstance(found, type)):
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")


class SafeMetadata:
    """Mixed into a DCP reader (local here, fsspec in fsspec_io.py): reads ``.metadata`` with the unpickler
    above, or hands out ``_metadata`` already read (by :func:`inspect_checkpoint`) instead of reading it again."""

    _metadata: Metadata | None
    fs: Any
    path: Any
    load_id: Any

    def safe_metadata(self) -> Metadata:
        metadata = self._metadata
        if metadata is None:
            with self.fs.create_stream(self.fs.concat_path(self.path, ".metadata"), "rb") as file:
                metadata = _MetadataUnpickler(file).load()
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(f"holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(SafeMetadata, FileSystemReader):
    """DCP's file reader with a ``.metadata`` unpickler that cannot run code (see :class:`SafeMetadata`)."""

    def __init__(self, path: str | Path, metadata: Metadata | None = None) -> None:
        super().__init__(str(path))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.safe_metadata()
