"""The loss-log writer on a damaged or full disk: a line cut by a kill is dropped before appending, and a
full disk is one clear error, not a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchtitan_rng.loss_log import LossLogError, LossLogWriter, read_loss_log


def test_a_line_cut_by_a_kill_is_dropped_before_appending(tmp_path: Path) -> None:
    log = tmp_path / "loss_log.jsonl"
    log.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "lo')  # killed while writing step 2
    with pytest.raises(LossLogError, match=":2: not a loss-log line"):
        read_loss_log(log)  # control: that cut line is what breaks the log
    writer = LossLogWriter(log)
    writer.write({"step": 2, "loss": torch.tensor(1.25)})
    writer.close()
    assert read_loss_log(log) == {1: {"step": 1, "loss": 2.5}, 2: {"step": 2, "loss": 1.25}}


def test_a_complete_log_is_left_as_it_is(tmp_path: Path) -> None:
    log = tmp_path / "loss_log.jsonl"
    log.write_text('{"step": 1, "loss": 2.5}\n')
    LossLogWriter(log).close()
    assert log.read_text() == '{"step": 1, "loss": 2.5}\n'


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux), a device that is always full")
def test_a_full_disk_is_one_clear_error() -> None:
    writer = LossLogWriter(Path("/dev/full"))
    writer.write({"step": 1, "loss": torch.tensor(0.5)})
    with pytest.raises(LossLogError, match=r"^/dev/full: the disk is full .*run the same command again"):
        writer.flush()
    writer.close()  # nothing left to fail at close


def test_a_cut_line_after_a_long_log_is_found(tmp_path: Path) -> None:
    log = tmp_path / "loss_log.jsonl"
    lines = "".join(f'{{"step": {step}, "loss": 0.5}}\n' for step in range(1, 5001))  # ~130 KB: several blocks
    log.write_text(lines + '{"step": 5001, "lo' + "x" * 70000)  # a cut line longer than one block
    LossLogWriter(log).close()
    assert log.read_text() == lines
