"""DCP's writer and reader for an fsspec URL (storage.FsspecStorage), as the local ones: a save without
torch.save's zip CRC (writer.py), a ``.metadata`` read that cannot run code (safe_load.py). Imported only by
dcp_io.py, when a checkpoint folder is a URL (it imports fsspec)."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.metadata import Metadata

from torchtitan_rng.checkpoint.safe_load import SafeMetadata
from torchtitan_rng.checkpoint.writer import COPY_AHEAD_BYTES, WithoutZipCrc


class ChecksummedFsspecWriter(WithoutZipCrc, FsspecWriter):
    def __init__(self, url: str, options: dict[str, Any]) -> None:
        super().__init__(url, per_thread_copy_ahead=COPY_AHEAD_BYTES, **options)


class SafeFsspecReader(SafeMetadata, FsspecReader):
    def __init__(self, url: str, metadata: Metadata | None = None, options: dict[str, Any] | None = None) -> None:
        super().__init__(url, **(options or {}))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.safe_metadata()
