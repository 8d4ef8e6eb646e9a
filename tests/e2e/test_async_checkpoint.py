"""checkpoint.async_mode = "async": the loop goes on while DCP writes, and resume stays exact."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from tests.support.launch import compare, together, train
from torchtitan_rng.checkpoint.owner import OWNER_NAME
from torchtitan_rng.loss_log import read_loss_log

TOTAL, STOP, INTERVAL = 12, 10, 4  # saves at 4 and 8 are async; 10 (the stop) and 12 (the end) synchronous


def _contents(path: Path) -> dict[str, Any]:
    """Everything a checkpoint holds, as full (unsharded) values, read by DCP in this process."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: assuming a single process"
        return _load_state_dict_from_keys(checkpoint_id=str(path))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Paths at which two checkpoint contents differ, bit for bit."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(set(a) ^ set(b))}"]
        return [d for key in sorted(a) for d in _differences(a[key], b[key], f"{where}.{key}" if where else key)]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
        return [] if same else [where]
    return [] if type(a) is type(b) and repr(a) == repr(b) else [where]


@pytest.mark.parametrize(("config", "nproc"), [("llama_debug", 2), ("flux_debug", 1)])
def test_resume_from_async_checkpoint_is_exact(tmp_path: Path, config: str, nproc: int) -> None:
    run_a, run_b = tmp_path / "A", tmp_path / "B"
    common = ["--checkpoint.enable", "--checkpoint.interval", str(INTERVAL), "--lr_scheduler.total_steps", str(TOTAL)]
    asynchronous = [*common, "--checkpoint.async_mode", "async"]

    def stop_and_resume_from_8() -> None:
        """B: async saves, stopped at 10; then resumed from the async checkpoint of step 8."""
        train(run_b, "--training.steps", str(STOP), *asynchronous, nproc=nproc, config=config)
        assert sorted(p.name for p in (run_b / "checkpoint").iterdir() if p.name != OWNER_NAME) == ["step-10", "step-4",
                                                                                                   "step-8"]
        train(run_b, "--training.steps", str(TOTAL), *asynchronous, "--checkpoint.load_step", "8", nproc=nproc,
              config=config)

    together(lambda: train(run_a, "--training.steps", str(TOTAL), *common, nproc=nproc, config=config),
             stop_and_resume_from_8)

    result = compare(run_a, run_b)
    assert result.returncode == 0, result.stdout
    lines = (run_b / "loss_log.jsonl").read_text().splitlines()
    assert len(lines) == STOP + (TOTAL - 8)  # steps 9 and 10 were redone from the step-8 checkpoint
    assert sorted(read_loss_log(run_b)) == list(range(1, TOTAL + 1))
    # The async checkpoints hold exactly what the synchronous ones of run A hold: model, optimizer, the
    # per-rank RNG and dataloader states of that step's boundary.
    for step in (4, 8):
        assert _differences(_contents(run_a / f"checkpoint/step-{step}"), _contents(run_b / f"checkpoint/step-{step}")) == []
    # Control: the comparison sees a difference where there is one.
    assert "train_state.step" in _differences(_contents(run_a / "checkpoint/step-4"), _contents(run_b / "checkpoint/step-8"))
