"""The torchtitan plug-in's loss log, in-process: what torchtitan's trainer hands its metrics processor is written
exactly, by the rank that holds the loss only (the launches: tests/e2e/test_torchtitan_plugin.py)."""

from __future__ import annotations

import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("torchtitan")


class Processor:
    """The part of torchtitan's MetricsProcessor the trainer calls at a logged step."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, float]] = []

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None) -> None:
        self.logged.append((step, global_avg_loss))


def _trainer(dump: Path, **degrees: int) -> SimpleNamespace:
    from torchtitan.distributed.parallel_dims import ParallelDims

    dims = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1) | degrees
    config = SimpleNamespace(dump_folder=str(dump), parallelism=SimpleNamespace(pipeline_parallel_schedule="1F1B"))
    return SimpleNamespace(parallel_dims=ParallelDims(**dims), config=config, metrics_processor=Processor())


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


def test_logged_steps_are_written_exactly_and_torchtitans_log_still_runs(tmp_path: Path) -> None:
    import torch

    from torchtitan_rng.integrations.torchtitan import attach_loss_log
    from torchtitan_rng.loss_log import read_loss_log

    trainer = _trainer(tmp_path)
    writer = attach_loss_log(trainer)
    assert writer is not None
    # float32 values as torchtitan reports them (a float32 tensor's .item()), one of them not a short decimal.
    losses = [float(torch.tensor(value, dtype=torch.float32).item()) for value in (5.943028926849365, 1 / 3, 2.5)]
    for step, loss in enumerate(losses, start=1):
        trainer.metrics_processor.log(step, loss, loss, 1.0, extra_metrics={"lr/AdamW": 8e-4})
    trainer.metrics_processor.log(2, 7.0, 7.0, 1.0, extra_metrics={"lr": 1e-3})  # step 2 again, after a resume
    writer.close()
    assert trainer.metrics_processor.logged == [(1, losses[0]), (2, losses[1]), (3, losses[2]), (2, 7.0)]
    records = read_loss_log(tmp_path)
    assert [_bits(records[step]["loss"]) for step in (1, 3)] == [_bits(losses[0]), _bits(losses[2])]
    assert records[2]["loss"] == 7.0 and records[2]["lr"] == 1e-3 and records[1]["lr"] == 8e-4
    # Control: the check above tells a float32 loss from the same value rounded as console output shows it.
    assert _bits(records[1]["loss"]) != _bits(float(f"{losses[0]:8.5f}"))


def test_only_the_rank_holding_the_loss_writes(tmp_path: Path) -> None:
    from torchtitan_rng.integrations.torchtitan import attach_loss_log

    # This process is rank 0. Under pipeline parallelism (2 stages) torchtitan's metrics rank is the first rank
    # of the last stage, 1: rank 0 logs -1.0 and writes nothing.
    pipelined = _trainer(tmp_path / "pp", pp=2, world_size=2)
    assert attach_loss_log(pipelined) is None
    assert not (tmp_path / "pp" / "loss_log.jsonl").exists()
    assert attach_loss_log(_trainer(tmp_path / "dp", dp_shard=2, world_size=2)) is not None
