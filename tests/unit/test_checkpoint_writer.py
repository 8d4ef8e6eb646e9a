"""Saves write tensors without torch.save's per-record zip CRC32 (checksums.json covers every byte), and
leave torch's process-wide CRC switch as they found it."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan_rng.checkpoint.manager import CheckpointManager
from torchtitan_rng.checkpoint.states import ModelState
from torchtitan_rng.checkpoint.train_state import TrainState


def record_crcs(folder: Path) -> list[int]:
    """The CRC32 of every zip record (its central directory entry) in the folder's .distcp files."""
    crcs = []
    for path in folder.rglob("*.distcp"):
        data = path.read_bytes()
        at = data.find(b"PK\x01\x02")
        while at >= 0:
            crcs.append(struct.unpack_from("<I", data, at + 16)[0])
            at = data.find(b"PK\x01\x02", at + 4)
    return crcs


def parts() -> dict[str, object]:
    torch.manual_seed(0)
    train_state = TrainState(torch.device("cpu"))
    train_state.step = 1
    return {"model": ModelState(torch.nn.Linear(64, 64)), "train_state": train_state}


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
@pytest.mark.parametrize("user_setting", [True, False])
def test_saves_skip_the_zip_crc_and_restore_the_switch(tmp_path: Path, async_mode: str, user_setting: bool) -> None:
    torch.serialization.set_crc32_options(user_setting)
    try:
        manager = CheckpointManager(tmp_path, parts(), interval=1, async_mode=async_mode)
        manager.save(1)
        manager.wait()
        assert torch.serialization.get_crc32_options() is user_setting
    finally:
        torch.serialization.set_crc32_options(True)
    crcs = record_crcs(tmp_path / "step-1")
    assert crcs and not any(crcs)


def test_control_a_plain_dcp_save_writes_the_crcs(tmp_path: Path) -> None:
    """The check above can fail: DCP's own writer computes a CRC for every record."""
    dcp.save(dict(parts()), checkpoint_id=str(tmp_path))
    crcs = record_crcs(tmp_path)
    assert crcs and all(crcs)
