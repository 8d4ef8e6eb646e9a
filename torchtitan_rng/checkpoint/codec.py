"""Per-rank state as one ``bytes`` value, with no pickle of our own.

DCP keeps one copy of a same-key non-DTensor value saved from every rank, so per-rank state (RNG,
dataloader position) is stored under rank-unique keys. Encoding each rank's nested state into one bytes
value keeps the checkpoint layout independent of how many workers or generators there are (DCP replaces
a non-tensor value on load, whatever its size), and decoding only parses JSON and copies raw tensor
bytes. DCP itself wraps the bytes with ``torch.save``; ``checkpoint.SafeLoadPlanner`` reads them back
with ``weights_only=True``, so loading never executes code.

Layout: 8-byte little-endian header length, a JSON header, then the raw bytes of every tensor and bytes value.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

_DTYPES: dict[str, torch.dtype] = {
    str(dtype): dtype
    for dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16, torch.int32,
                  torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool)
}


def encode_state(obj: Any) -> bytes:
    payload: list[bytes] = []

    def to_json(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            tensor = item.detach().cpu().contiguous()
            payload.append(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
            return {"t": len(payload) - 1, "dtype": str(tensor.dtype), "shape": list(tensor.shape)}
        if isinstance(item, np.ndarray):
            return to_json(torch.from_numpy(np.ascontiguousarray(item)))
        if isinstance(item, bytes):
            payload.append(item)
            return {"b": len(payload) - 1}
        if isinstance(item, dict):
            return {"d": [[to_json(key), to_json(value)] for key, value in item.items()]}
        if isinstance(item, tuple):
            return {"tuple": [to_json(sub) for sub in item]}
        if isinstance(item, list):
            return [to_json(sub) for sub in item]
        if isinstance(item, np.generic):
            return item.item()
        if item is None or isinstance(item, (bool, int, float, str)):
            return item
        raise TypeError(f"cannot store a {type(item).__name__} in a checkpoint state: use tensors and plain values")

    root = to_json(obj)
    header = json.dumps({"root": root, "sizes": [len(chunk) for chunk in payload]}).encode()
    return len(header).to_bytes(8, "little") + header + b"".join(payload)


def decode_state(raw: bytes) -> Any:
    if not isinstance(raw, bytes) or len(raw) < 8:
        raise ValueError("not an encoded state (expected bytes written by encode_state)")
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    offsets = np.cumsum([8 + header_len] + header["sizes"]).tolist()

    def from_json(item: Any) -> Any:
        if isinstance(item, list):
            return [from_json(sub) for sub in item]
        if isinstance(item, dict):
            if "d" in item:
                return {from_json(key): from_json(value) for key, value in item["d"]}
            if "tuple" in item:
                return tuple(from_json(sub) for sub in item["tuple"])
            if "b" in item:
                return raw[offsets[item["b"]] : offsets[item["b"] + 1]]
            start, end = offsets[item["t"]], offsets[item["t"] + 1]
            dtype = _DTYPES[item["dtype"]]
            data = torch.frombuffer(bytearray(raw[start:end]), dtype=torch.uint8) if end > start else torch.empty(0, dtype=torch.uint8)
            return data.view(dtype).reshape(item["shape"])
        return item

    return from_json(header["root"])
