"""ExactResumeTrainer under torchrun (2 processes, gloo, 2 loader workers each, accumulation 2) with
evaluation that draws from the global streams: a ``max_steps`` stop (HF evaluates at the end of training
before it saves) and a checkpoint at an evaluation step, whoever asked for it (``save_steps``, a user's
callback, the integration on a signal), resume bitwise, with the epoch the uninterrupted run logs; signal handling lasts only as long as ``train()`` and has one owner with
``enable_jit_checkpoint``; a stock Trainer checkpoint is refused, or resumed once inexactly on request;
an unsupported ``train_sampling_strategy`` is refused in one line."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from tests.support.checks import assert_same_tensors
from tests.support.integrations import PRELOAD
from tests.support.launch import REPO, launch, run_env, together

SCRIPT = "tests.support.integrations.hf_run"
# 24 samples, batch 2, accumulation 2: 6 optimizer steps an epoch; evaluation and saves every 3 steps.
COMMON = ("--workers", "2", "--ga", "2", "--eval-steps", "3", "--save-steps", "3")
STEPS, STOP = 8, 4
TWICE = (*COMMON, "--save-steps", "1000", "--jit", "--max-steps", str(STOP))


def _run(out: Path, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "-m"]
    return launch([*launcher, SCRIPT, "--out", str(out), *args], timeout=240, processes=nproc,
                  preload=PRELOAD[SCRIPT])


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"{' '.join(proc.args)} exited {proc.returncode}\n{proc.stderr[-4000:]}"
    return proc


def _lines(out: Path, kind: str, rank: int = 0) -> list[str]:
    return (out / f"{kind}_rank{rank}.txt").read_text().splitlines()


def _seed_from(source: Path, target: Path, checkpoint: str, steps: int, nproc: int) -> None:
    """``target`` as a run stopped at ``checkpoint`` of ``source``: that checkpoint and the records so far."""
    shutil.copytree(source / "ckpt" / checkpoint, target / "ckpt" / checkpoint)
    for rank in range(nproc):
        for kind in ("losses", "epochs"):
            (target / f"{kind}_rank{rank}.txt").write_text("".join(
                line + "\n" for line in _lines(source, kind, rank)[:steps]))


CONSTRUCTION_CHECKS = """
import sys, transformers
from tests.support.integrations.common import NoisyDataset
from tests.support.integrations.hf_run import HFNet
from torchtitan_rng.integrations.hf import ExactResumeTrainer
def args(**kw):
    return transformers.TrainingArguments(output_dir=sys.argv[1], use_cpu=True, report_to=[], **kw)
for kw, extra in (({'train_sampling_strategy': 'group_by_length'}, {}), ({}, {'on_stock_checkpoint': 'maybe'})):
    try:
        ExactResumeTrainer(model=HFNet(), args=args(**kw), train_dataset=NoisyDataset(8), **extra)
    except ValueError as err:  # ConfigError is one
        print('REFUSED', err)
try:  # a stock Trainer's checkpoint, without on_stock_checkpoint="warn"
    ExactResumeTrainer(model=HFNet(), args=args(max_steps=8), train_dataset=NoisyDataset(24)).train(
        resume_from_checkpoint=sys.argv[2])
except ValueError as err:
    print('REFUSED', err)
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    names = ("A", "B", "A_at3", "nofork", "nofork_b", "twice", "twice2", "twice_at3", "stock", "migrated", "checks")
    d = {name: tmp_path_factory.mktemp(name) for name in names}
    started = time.monotonic()
    wave1 = together(
        lambda: _ok(_run(d["A"], *COMMON, "--max-steps", str(STEPS))),
        # Its checkpoint-3 saved by a user's callback (not save_steps), at evaluation step 3.
        lambda: _ok(_run(d["B"], *COMMON, "--save-steps", "1000", "--save-at", "3", "--max-steps", str(STOP))),
        # The control, one process: the same runs with evaluation moving the streams.
        lambda: _ok(_run(d["nofork"], *COMMON, "--no-eval-fork", "--max-steps", str(STEPS), nproc=1)),
        lambda: _ok(_run(d["nofork_b"], *COMMON, "--no-eval-fork", "--max-steps", str(STOP), nproc=1)),
        # One process, with enable_jit_checkpoint: a train() stopped by its own SIGTERM at step 2 (saved by the
        # integration alone, at evaluation step 3), a second train(), then a SIGTERM outside training.
        lambda: _run(d["twice"], *TWICE, "--signal-at", "2", "--again", str(d["twice2"]), "--sigterm-after", nproc=1),
        lambda: _ok(_run(d["stock"], "--stock", "--max-steps", str(STOP), "--save-steps", str(STOP), nproc=1)),
    )
    _seed_from(d["A"], d["A_at3"], "checkpoint-3", 3, nproc=2)
    _seed_from(d["twice"], d["twice_at3"], "checkpoint-3", 3, nproc=1)
    _seed_from(d["stock"], d["migrated"], f"checkpoint-{STOP}", STOP, nproc=1)
    wave2 = together(
        lambda: _ok(_run(d["B"], *COMMON, "--max-steps", str(STEPS), "--resume")),
        lambda: _ok(_run(d["A_at3"], *COMMON, "--max-steps", str(STEPS), "--resume")),
        lambda: _ok(_run(d["twice_at3"], *TWICE, "--resume", nproc=1)),
        lambda: _ok(_run(d["nofork_b"], *COMMON, "--no-eval-fork", "--max-steps", str(STEPS), "--resume", nproc=1)),
        lambda: subprocess.run([sys.executable, "-c", CONSTRUCTION_CHECKS, str(d["checks"]),
                                str(d["stock"] / "ckpt" / f"checkpoint-{STOP}")], cwd=REPO, capture_output=True,
                               text=True, env=run_env(), timeout=240),
        lambda: _run(d["migrated"], "--max-steps", str(STEPS), "--save-steps", str(STOP), "--resume",
                     "--on-stock-checkpoint", "warn", nproc=1),
    )
    print(f"\nhf stop runs: {time.monotonic() - started:.1f} s wall")
    return {"dirs": d, "twice": wave1[4], "checks": wave2[4], "migrated": wave2[5]}


def test_a_max_steps_stop_resumes_bitwise_with_the_logged_epoch(runs: dict[str, Any]) -> None:
    # Stopped by max_steps at step 4, not an evaluation step: HF evaluates at the end of training, then saves.
    d = runs["dirs"]
    for rank in (0, 1):
        assert len(_lines(d["A"], "losses", rank)) == STEPS
        assert _lines(d["B"], "losses", rank) == _lines(d["A"], "losses", rank)
        assert _lines(d["B"], "epochs", rank) == _lines(d["A"], "epochs", rank)
    assert _lines(d["A"], "losses", 0) != _lines(d["A"], "losses", 1)


def test_an_evaluation_step_checkpoint_resumes_bitwise(runs: dict[str, Any]) -> None:
    d = runs["dirs"]
    for rank in (0, 1):
        assert _lines(d["A_at3"], "losses", rank) == _lines(d["A"], "losses", rank)
        assert _lines(d["A_at3"], "epochs", rank) == _lines(d["A"], "epochs", rank)


def _checkpoint(folder: Path, nproc: int) -> dict[str, Any]:
    """What a resume reads from an ExactResumeTrainer checkpoint: model, optimizer, schedule, every rank's loader
    and streams."""
    parts: dict[str, Any] = {"model": safetensors.torch.load_file(folder / "model.safetensors")}
    for name in ("optimizer.pt", "scheduler.pt", *(f"exact_resume_rank{rank}.pt" for rank in range(nproc))):
        parts[name] = torch.load(folder / name, weights_only=False)
    return parts


def test_a_users_save_at_an_evaluation_step_is_the_uninterrupted_runs_checkpoint(runs: dict[str, Any]) -> None:
    # B's checkpoint-3, asked for by a user's callback, holds what A's (save_steps, resumed bitwise above) holds.
    d = runs["dirs"]
    assert_same_tensors(_checkpoint(d["B"] / "ckpt" / "checkpoint-3", 2), _checkpoint(d["A"] / "ckpt" / "checkpoint-3", 2))


def test_the_integrations_own_save_at_an_evaluation_step_resumes_bitwise(runs: dict[str, Any]) -> None:
    # The signal-triggered checkpoint-3 of the first train() (one process), resumed: the second train() in that
    # process ran the same configuration uninterrupted.
    d = runs["dirs"]
    assert _lines(d["twice_at3"], "losses") == _lines(d["twice2"], "losses")
    assert _lines(d["twice_at3"], "epochs") == _lines(d["twice2"], "epochs")


def test_control_evaluation_moving_the_streams_differs_after_the_stop(runs: dict[str, Any]) -> None:
    d = runs["dirs"]
    reference, resumed = _lines(d["nofork"], "losses"), _lines(d["nofork_b"], "losses")
    assert len(resumed) == STEPS and resumed[:STOP] == reference[:STOP] and resumed[STOP] != reference[STOP]


def test_signal_handling_lasts_only_as_long_as_train_and_has_one_owner(runs: dict[str, Any]) -> None:
    # With enable_jit_checkpoint: the first train(), signalled during step 2, saved checkpoint-3 (the callback
    # votes before the recording one sends the signal, so it sees it a step later) and stopped; the second
    # ran all its steps with the first's losses; a SIGTERM outside train() ended the process (the stock JIT
    # handler, had it stayed, would have swallowed it).
    d, proc = runs["dirs"], runs["twice"]
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-4000:]
    assert not (d["twice"] / "survived_sigterm").exists()
    assert sorted(p.name for p in (d["twice"] / "ckpt").iterdir()) == ["checkpoint-3"]
    assert not (d["twice"] / "ckpt" / "checkpoint-3" / "checkpoint-is-incomplete.txt").exists()
    first, second = _lines(d["twice"], "losses"), _lines(d["twice2"], "losses")
    assert len(first) == 3 and len(second) == STOP and second[:3] == first


def test_a_stock_checkpoint_is_refused_or_resumed_once_inexactly(runs: dict[str, Any]) -> None:
    refusals = [line for line in runs["checks"].stdout.splitlines() if line.startswith("REFUSED")]
    assert any("written by the stock Trainer" in line and 'on_stock_checkpoint="warn"' in line for line in refusals)
    migrated = runs["migrated"]
    assert migrated.returncode == 0, migrated.stderr[-4000:]
    assert migrated.stderr.count("written by the stock Trainer, inexactly") == 1
    assert len(_lines(runs["dirs"]["migrated"], "losses")) == STEPS
    assert (runs["dirs"]["migrated"] / "ckpt" / f"checkpoint-{STEPS}" / "exact_resume_rank0.pt").is_file()


def test_unsupported_options_are_refused_in_one_line(runs: dict[str, Any]) -> None:
    proc = runs["checks"]
    refusals = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refusals) == 3, proc.stdout + proc.stderr[-3000:]
    assert "train_sampling_strategy='group_by_length'" in refusals[0] and "'random' or 'sequential'" in refusals[0]
    assert "on_stock_checkpoint='maybe'" in refusals[1]
