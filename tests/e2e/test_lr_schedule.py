"""The config is the truth for the learning-rate schedule: a checkpoint carries how far the schedule has
gone, never its shape, so a resume with another ``training.steps`` or ``lr_scheduler.total_steps`` follows
the config (the lr of each resumed step equals the schedule's formula for that config, bit for bit)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.launch import REPO, train
from torchtitan_rng.config import lr_total_steps, parse_args
from torchtitan_rng.lr_scheduler import WarmupDecay

CONFIG = REPO / "train_configs" / "llama_debug.toml"
CHECKPOINTED = ("--checkpoint.enable", "--checkpoint.interval", "3")


def _logged_lr(dump: Path) -> dict[int, str]:
    lines = [json.loads(line) for line in (dump / "loss_log.jsonl").read_text().splitlines()]
    return {line["step"]: float(line["lr"]).hex() for line in lines}


def _formula_lr(step: int, *overrides: str) -> str:
    """The lr of ``step`` in a fresh run with these overrides: the schedule's formula, as bits."""
    config = parse_args(["--job.config_file", str(CONFIG), *overrides])
    schedule = WarmupDecay(config.lr_scheduler.warmup_steps, lr_total_steps(config), config.lr_scheduler.decay_type,
                           config.lr_scheduler.min_lr_factor)
    return (config.optimizer.lr * schedule(step - 1)).hex()


@pytest.fixture(scope="module")
def extended(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 6-step run, extended to 8 steps, then to 10 with the schedule pinned to 12 steps."""
    dump = tmp_path_factory.mktemp("lr_truth")
    # A moved horizon is refused unless allowed (tests/e2e/test_config_drift.py); allowed, the config's applies.
    allowed = ("--checkpoint.allow_config_change", "lr_scheduler.total_steps")
    train(dump, "--training.steps", "6", *CHECKPOINTED)
    train(dump, "--training.steps", "8", *CHECKPOINTED, *allowed)
    train(dump, "--training.steps", "10", "--lr_scheduler.total_steps", "12", *CHECKPOINTED, *allowed)
    return dump


def test_extending_a_finished_run_follows_the_new_schedule(extended: Path) -> None:
    logged = _logged_lr(extended)
    for step in (7, 8):
        assert logged[step] == _formula_lr(step, "--training.steps", "8")
    assert float.fromhex(logged[7]) > 0.0  # the 6-step schedule ended at 0: it would train at lr 0 here
    # Control: the finished run's schedule gives other values at these steps, so the check can fail.
    assert _formula_lr(7, "--training.steps", "6") != logged[7]


def test_changed_total_steps_is_used_from_the_first_resumed_step(extended: Path) -> None:
    logged = _logged_lr(extended)
    for step in (9, 10):
        assert logged[step] == _formula_lr(step, "--training.steps", "10", "--lr_scheduler.total_steps", "12")
    assert _formula_lr(9, "--training.steps", "8") != logged[9]  # control: the checkpoint's 8-step schedule
