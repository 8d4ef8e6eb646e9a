"""A new run never appends to another run's loss log, and resuming is advised only where there is a checkpoint:
preflight's rule, in process, on real dump folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.launch import REPO
from torchtitan_rng.config import ConfigError, parse_args
from torchtitan_rng.launch import preflight

CONFIG = str(REPO / "train_configs" / "llama_debug.toml")


def _dump(tmp_path: Path, last_step: int, checkpoint: int | None = None, cut: bool = False) -> Path:
    """A dump folder with a loss log of steps 1..last_step (and a complete checkpoint, a last line cut by a kill)."""
    dump = tmp_path / "run"
    dump.mkdir()
    lines = "".join(json.dumps({"step": step, "loss": 1.0, "lr": 0.1}) + "\n" for step in range(1, last_step + 1))
    (dump / "loss_log.jsonl").write_text(lines + ('{"step": 99, "lo' if cut else ""))
    if checkpoint is not None:
        step = dump / "checkpoint" / f"step-{checkpoint}"
        step.mkdir(parents=True)
        (step / "complete.json").write_text(json.dumps({"step": checkpoint}) + "\n")
    return dump


def _config(dump: Path, *overrides: str):  # type: ignore[no-untyped-def]
    return parse_args(["--job.config_file", CONFIG, "--job.dump_folder", str(dump), "--checkpoint.interval", "5",
                       *overrides])


def test_no_resume_is_advised_where_there_is_no_checkpoint(tmp_path: Path) -> None:
    dump = _dump(tmp_path, 10)
    with pytest.raises(ConfigError) as err:
        preflight.refuse_restart_over_history(_config(dump))
    message = str(err.value)
    assert "it holds no checkpoint to resume: pass another --job.dump_folder" in message
    assert "--checkpoint.enable" not in message and "\n" not in message


def test_resume_is_advised_where_there_is_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="add --checkpoint.enable to resume it, or pass another --job.dump_folder"):
        preflight.refuse_restart_over_history(_config(_dump(tmp_path, 10, checkpoint=5)))


def test_checkpointing_does_not_append_a_new_run_to_another_runs_log(tmp_path: Path) -> None:
    """A log to step 10 and no checkpoint, with --checkpoint.enable (saves every 5): not this run's own redo."""
    dump = _dump(tmp_path, 10)
    with pytest.raises(ConfigError) as err:
        preflight.refuse_restart_over_history(_config(dump, "--checkpoint.enable"))
    assert str(err.value) == (f"dump folder {dump} holds a loss log up to step 10 and no checkpoint to resume "
                              "from, so this run would start again from step 1 and append a second run to that "
                              "log: pass another --job.dump_folder (or move this one away) to start afresh")


@pytest.mark.parametrize(("last_step", "checkpoint", "cut"), [
    (2, None, False),  # killed before its first save (step 5): the same run, redone
    (5, None, True),   # killed while saving step 5 (the log is flushed before), a line cut
    (12, 10, False),   # a resume: it appends to its own history
], ids=["crash-before-first-save", "crash-in-first-save", "resume"])
def test_a_runs_own_history_goes_on(tmp_path: Path, last_step: int, checkpoint: int | None, cut: bool) -> None:
    preflight.refuse_restart_over_history(_config(_dump(tmp_path, last_step, checkpoint, cut), "--checkpoint.enable"))


def _prints(dump: Path, last_step: int) -> None:
    """Tensor fingerprints of steps 1..last_step in the dump folder (a run of one process)."""
    folder = dump / "tensor_fingerprints"
    folder.mkdir(parents=True)
    (folder / "rank0.jsonl").write_text("".join(json.dumps({"step": step, "world_size": 1}) + "\n"
                                                for step in range(1, last_step + 1)))


def test_another_runs_tensor_fingerprints_are_a_history_too(tmp_path: Path) -> None:
    """A reused dump folder whose loss log and checkpoints were removed, its tensor_fingerprints/ left: a fresh
    start would have compare_losses read them as its own."""
    dump = tmp_path / "run"
    dump.mkdir()
    _prints(dump, 10)
    with pytest.raises(ConfigError) as err:
        preflight.refuse_restart_over_history(_config(dump, "--checkpoint.enable"))
    assert str(err.value) == (f"dump folder {dump} holds tensor fingerprints (tensor_fingerprints/) up to step 10 "
                              "and no checkpoint to resume from, so this run would start again from step 1 and "
                              "append a second run to that log: pass another --job.dump_folder (or move this one "
                              "away) to start afresh")
    with pytest.raises(ConfigError) as err:
        preflight.refuse_restart_over_history(_config(dump))
    assert str(err.value).startswith(f"dump folder {dump} already holds a run (tensor_fingerprints/) and "
                                     "checkpoint.enable is off") and "it holds no checkpoint to resume" in str(err.value)
    again = tmp_path / "redo"
    again.mkdir()
    _prints(again, 2)  # the control: killed before its first save (step 5), the same run redone
    preflight.refuse_restart_over_history(_config(again, "--checkpoint.enable"))
