"""Damaged checkpoints (an empty newer step folder, a truncated or missing shard) and one from another
model shape: refused in one line, exit 2, nothing of the user's touched."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from tests.support.checks import assert_refused, snapshot
from tests.support.launch import STEP2, train


def _empty_newer_step(ckpt: Path) -> None:
    (ckpt / "step-9").mkdir()


def _truncate_shard(ckpt: Path) -> None:
    shard = ckpt / "step-2" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _delete_shard(ckpt: Path) -> None:
    (ckpt / "step-2" / "__0_0.distcp").unlink()


DAMAGE: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "empty step folder": (_empty_newer_step, ("step-9 is incomplete (no .metadata", "--checkpoint.load_step")),
    "truncated shard": (_truncate_shard, ("shard file __0_0.distcp is truncated",)),
    "missing shard": (_delete_shard, ("shard file __0_0.distcp is missing",)),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_checkpoint_is_refused(user_dump: Path, case: str) -> None:
    damage, fragments = DAMAGE[case]
    damage(user_dump / "checkpoint")
    before = snapshot(user_dump)
    assert_refused(train(user_dump, "--training.steps", "4", *STEP2, check=False), *fragments)
    assert snapshot(user_dump) == before


def test_other_model_shape(user_dump: Path) -> None:
    before = snapshot(user_dump)
    # Allowed to change, so that the load itself meets the other shapes.
    assert_refused(train(user_dump, "--model.flavor", "small", "--training.steps", "4", *STEP2,
                         "--checkpoint.allow_config_change", "model.flavor", check=False),
                   "does not fit this run", "Size mismatch", "model.embed.weight")
    assert snapshot(user_dump) == before
