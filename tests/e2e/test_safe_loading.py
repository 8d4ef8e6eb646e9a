"""Crafted pickles in a checkpoint are never executed: refused in one line (docs/design.md, "Safe loading"),
each with a control showing that DCP's own loading runs the payload."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from tests.support.checks import assert_refused, rewrite_checkpoint
from tests.support.launch import STEP2, train
from torchtitan_rng.checkpoint.layout import TRAIN_STATE, rank_key

RANK_0 = rank_key(0)  # rank 0's own value in the train state


class _CreatesFile:
    """Unpickling this opens (creates) a file: the stand-in for any code a crafted checkpoint runs."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def test_pickle_payload_in_a_non_tensor_item(user_dump: Path, tmp_path: Path) -> None:
    marker = tmp_path / "payload_ran"
    ckpt = user_dump / "checkpoint" / "step-2"

    def plant(state: dict[str, Any]) -> None:
        state[TRAIN_STATE][RANK_0] = _CreatesFile(marker)

    rewrite_checkpoint(ckpt, tmp_path, plant)
    assert_refused(train(user_dump, "--training.steps", "3", *STEP2, check=False),
                    f"refusing to load checkpoint item '{TRAIN_STATE}.{RANK_0}'", "not plain data")
    assert not marker.exists()
    # Control: the payload is real; DCP's own load planner runs it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({TRAIN_STATE: {RANK_0: b""}}, checkpoint_id=str(ckpt))
    assert marker.exists()


def test_pickle_payload_as_metadata(user_dump: Path, tmp_path: Path) -> None:
    marker = tmp_path / "payload_ran"
    ckpt = user_dump / "checkpoint" / "step-2"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_CreatesFile(marker)))
    assert_refused(train(user_dump, "--training.steps", "3", *STEP2, check=False),
                    "its .metadata is missing or damaged", "open is not part of DCP metadata")
    assert not marker.exists()
    FileSystemReader(str(ckpt)).read_metadata()  # control: DCP's own reader runs it
    assert marker.exists()
