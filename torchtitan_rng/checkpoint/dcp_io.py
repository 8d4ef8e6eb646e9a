"""DCP's storage reader and writer for a checkpoint location, chosen by its storage type (storage.py), and the
one read of a checkpoint's index before a load.

* A local folder (:class:`storage.LocalStorage`): DCP's file writer without torch.save's zip CRC (writer.py) and
  its file reader with a ``.metadata`` unpickler that cannot run code (safe_load.py).
* An fsspec store (:class:`storage.FsspecStorage`): the same two over DCP's fsspec classes (fsspec_io.py, imported
  only here and only for a store: it imports fsspec, which a run on a local folder never loads), opened with the
  store's own options (storage.S3_ANSWER: how long a request waits).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from torchtitan_rng.checkpoint.integrity import RESUME_ADVICE
from torchtitan_rng.checkpoint.layout import CheckpointInfo
from torchtitan_rng.checkpoint.safe_load import SafeFileSystemReader
from torchtitan_rng.checkpoint.storage import FsspecStorage, Location, Where, locate
from torchtitan_rng.checkpoint.writer import ChecksummedFileSystemWriter
from torchtitan_rng.errors import CheckpointError, first_line


def writer(folder: Location) -> Any:
    """DCP's StorageWriter for a save into ``folder``."""
    storage = folder.storage
    if isinstance(storage, FsspecStorage):
        from torchtitan_rng.checkpoint.fsspec_io import ChecksummedFsspecWriter  # imports fsspec: a store only

        return ChecksummedFsspecWriter(str(folder), storage.options)
    return ChecksummedFileSystemWriter(Path(folder.path))


def reader(folder: Location, metadata: Metadata | None = None) -> Any:
    """DCP's StorageReader for ``folder``, with the safe metadata reader; ``metadata``: already read."""
    storage = folder.storage
    if isinstance(storage, FsspecStorage):
        from torchtitan_rng.checkpoint.fsspec_io import SafeFsspecReader  # imports fsspec: a store only

        return SafeFsspecReader(str(folder), metadata, storage.options)
    return SafeFileSystemReader(folder.path, metadata)


def inspect_checkpoint(path: Where) -> CheckpointInfo:
    """The metadata of a complete, undamaged checkpoint: every shard file there and long enough."""
    path = locate(path)
    try:
        metadata = reader(path).read_metadata()
    except CheckpointError:  # a store that failed: already one line naming it
        raise
    except Exception as err:  # a missing, truncated or crafted .metadata, whatever the error type
        raise CheckpointError(
            f"checkpoint {path} cannot be read: its .metadata is missing or damaged ({type(err).__name__}: "
            f"{first_line(err)}); {RESUME_ADVICE}"
        ) from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise CheckpointError(f"checkpoint {path} is damaged: shard file {name} is missing; {RESUME_ADVICE}")
        if shard.size() < size:
            raise CheckpointError(f"checkpoint {path} is damaged: shard file {name} is truncated "
                                  f"({shard.size()} bytes, {size} expected); {RESUME_ADVICE}")
    return CheckpointInfo(path, metadata)
