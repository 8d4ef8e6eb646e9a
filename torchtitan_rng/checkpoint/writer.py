"""The storage writer of every save: DCP's FileSystemWriter without torch.save's per-record zip CRC32.

DCP writes each tensor with ``torch.save``, which computes a CRC32 over its bytes (about 1 GB/s here: the
largest CPU cost of a save after the copy). ``checksums.json`` (integrity.py) already covers every byte of
every file, and is verified before a load; the CRC adds nothing to it. torch's switch for that CRC is
process-wide, so it is off only while this writer writes: a ``torch.save`` of the user's in another
thread at that moment is written without its CRC too, which ``torch.load`` does not need.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter


class ChecksummedFileSystemWriter(FileSystemWriter):
    def write_data(self, plan: Any, planner: Any) -> Any:
        previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            return super().write_data(plan, planner)
        finally:
            torch.serialization.set_crc32_options(previous)
