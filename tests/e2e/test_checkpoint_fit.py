"""Checkpoints that do not fit the run — another process count, another device type, no RNG state: refused
in one line naming both sides, or continued inexactly with a warning when the user asks for it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.support.checks import assert_refused, rewrite_checkpoint, snapshot
from tests.support.launch import STEP2, train
from torchtitan_rng.checkpoint.codec import decode_state, encode_state
from torchtitan_rng.checkpoint.layout import TRAIN_STATE, rank_key

RANK_0 = rank_key(0)  # rank 0's own value in the train state


def test_other_world_size_refused_naming_both_sizes(user_dump: Path) -> None:
    before = snapshot(user_dump)
    assert_refused(train(user_dump, "--training.steps", "4", *STEP2, nproc=2, check=False),
                    "saved by 1 processes and this run has 2", "--checkpoint.on_world_size_change reseed")
    assert snapshot(user_dump) == before


def test_other_world_size_with_reseed_warns_and_continues(user_dump: Path) -> None:
    proc = train(user_dump, "--training.steps", "3", *STEP2, "--checkpoint.on_world_size_change", "reseed", nproc=2)
    assert "WARNING: resuming" in proc.stdout and "no longer exact" in proc.stdout
    assert [json.loads(line)["step"] for line in (user_dump / "loss_log.jsonl").read_text().splitlines()] == [1, 2, 3]


def _edit_rank_blob(state: dict[str, Any], **changes: Any) -> None:
    blob = decode_state(state[TRAIN_STATE][RANK_0])
    blob.update(changes)
    state[TRAIN_STATE][RANK_0] = encode_state(blob)


def test_other_device_type(user_dump: Path, tmp_path: Path) -> None:
    """A checkpoint whose per-rank state says CUDA (16-byte Philox state), resumed on this CPU run."""
    def to_cuda(state: dict[str, Any]) -> None:
        rng = decode_state(state[TRAIN_STATE][RANK_0])["rng"]
        rng.update(device_type="cuda", device=torch.zeros(16, dtype=torch.uint8))
        _edit_rank_blob(state, device_type="cuda", rng=rng)

    rewrite_checkpoint(user_dump / "checkpoint" / "step-2", tmp_path, to_cuda)
    before = snapshot(user_dump)
    assert_refused(train(user_dump, "--training.steps", "3", *STEP2, check=False),
                    "was saved on cuda and this run is on cpu", "--checkpoint.allow_device_type_change")
    assert snapshot(user_dump) == before
    proc = train(user_dump, "--training.steps", "3", *STEP2, "--checkpoint.allow_device_type_change")
    assert "WARNING" in proc.stdout and "CPU, NumPy and Python streams restored" in proc.stdout


def test_checkpoint_without_rng_state(user_dump: Path, tmp_path: Path) -> None:
    rewrite_checkpoint(user_dump / "checkpoint" / "step-2", tmp_path, lambda s: s[TRAIN_STATE].pop(RANK_0))
    before = snapshot(user_dump)
    assert_refused(train(user_dump, "--training.steps", "3", *STEP2, "--checkpoint.strict_rng", check=False),
                    "holds no RNG state", "strict_rng")
    assert snapshot(user_dump) == before
    proc = train(user_dump, "--training.steps", "3", *STEP2)
    assert "WARNING: checkpoint" in proc.stdout and "holds no RNG state" in proc.stdout
