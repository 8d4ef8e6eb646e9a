"""DCP ``.metadata`` in every form the supported Pythons write loads through the safe reader, and ``getattr``
is accepted only as a member of a DCP metadata enum by its name.

Python 3.11.2 (Debian 12) and 3.12+ pickle an enum member as ``getattr(cls, name)``; other versions (pyenv's
3.11.7) as ``cls(value)``. A pickler with a ``reducer_override`` writes either form on any interpreter, so
both are checked wherever the suite runs, at protocols 2, 4 and 5.
"""

from __future__ import annotations

import enum
import io
import pathlib
import pickle
import pickletools
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata

from torchtitan_rng.checkpoint.safe_load import SafeFileSystemReader

PROTOCOLS = (2, 4, 5)  # 2: the oldest with new-style classes; 4: DCP's default on 3.10-3.13


class _EnumForm(pickle.Pickler):
    """Pickles enum members in one chosen form, whatever this interpreter's own."""

    def __init__(self, file: Any, protocol: int, by_name: bool) -> None:
        super().__init__(file, protocol=protocol)
        self.by_name = by_name

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, enum.Enum):
            return (getattr, (type(obj), obj.name)) if self.by_name else (type(obj), (obj.value,))
        return NotImplemented


def _dumps(obj: Any, protocol: int, by_name: bool) -> bytes:
    buffer = io.BytesIO()
    _EnumForm(buffer, protocol, by_name).dump(obj)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def metadata(tmp_path_factory: pytest.TempPathFactory) -> Metadata:
    """Real DCP metadata: enum members (each tensor's memory format), dtypes, sizes and storage records."""
    folder = tmp_path_factory.mktemp("ckpt")
    state = {"w": torch.randn(2, 3), "n": torch.arange(4, dtype=torch.int64), "extra": {"step": 3}}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return FileSystemReader(str(folder)).read_metadata()


def _read(tmp_path: Path, raw: bytes) -> Metadata:
    (tmp_path / ".metadata").write_bytes(raw)
    return SafeFileSystemReader(tmp_path).read_metadata()


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("by_name", [False, True], ids=["by_value", "by_name"])
def test_each_enum_form_loads(metadata: Metadata, tmp_path: Path, protocol: int, by_name: bool) -> None:
    raw = _dumps(metadata, protocol, by_name)
    opcodes = "".join(f"{op.name} {arg}\n" for op, arg, _ in pickletools.genops(raw))
    # Control: the pickle is in the form the test claims (a getattr call, or none at all).
    assert ("getattr" in opcodes) == by_name
    loaded = _read(tmp_path, raw)
    assert loaded.state_dict_metadata == metadata.state_dict_metadata
    assert loaded.storage_data == metadata.storage_data


def _getattr_pickle(target: Any, name: str, protocol: int) -> bytes:
    class _Call:
        def __reduce__(self) -> tuple[Any, ...]:
            return (getattr, (target, name))

    return pickle.dumps(_Call(), protocol=protocol)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("target,name", [
    (pathlib.PosixPath, "write_text"),               # a class the reader allows, but not an enum
    (signal.Signals, "SIGTERM"),                     # an enum, but not one of DCP's
    (_MEM_FORMAT_ENCODING, "__class__"),             # DCP's enum, but not a member
    (_MEM_FORMAT_ENCODING, "_missing_"),
], ids=["allowed_class", "other_enum", "dunder", "enum_method"])
def test_getattr_outside_dcp_enum_members_is_refused(tmp_path: Path, protocol: int, target: Any,
                                                     name: str) -> None:
    with pytest.raises(pickle.UnpicklingError, match="is not part of DCP metadata"):
        _read(tmp_path, _getattr_pickle(target, name, protocol))
    # Control: plain pickle resolves the same bytes to the attribute.
    assert pickle.loads(_getattr_pickle(target, name, protocol)) == getattr(target, name)
