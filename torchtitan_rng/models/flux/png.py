"""A minimal PNG writer (8-bit RGB, no filtering) using only zlib and struct, so no imaging library is needed."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, data: bytes) -> bytes:
    # Length, type, data, then a CRC over type + data (PNG spec section 5.3).
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(rgb: np.ndarray) -> bytes:
    """The PNG bytes of an ``[H, W, 3]`` uint8 array."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected an [H, W, 3] uint8 array, got {rgb.dtype} {rgb.shape}")
    height, width, _ = rgb.shape
    # Bit depth 8, colour type 2 (RGB), default compression/filter methods, no interlace.
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    # Each scanline starts with its filter type; 0 (None) keeps the writer trivial.
    rows = np.concatenate([np.zeros((height, 1), dtype=np.uint8), rgb.reshape(height, width * 3)], axis=1)
    return (
        PNG_SIGNATURE
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(rows.tobytes(), 9))
        + _chunk(b"IEND", b"")
    )


def write_png(path: Path, rgb: np.ndarray) -> None:
    """Write ``rgb`` to ``path`` atomically (a reader never sees half a file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(encode_png(rgb))
    tmp.replace(path)
