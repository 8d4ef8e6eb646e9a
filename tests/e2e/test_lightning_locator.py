"""The tensor locator in the Lightning integration (ExactResumeCallback(tensor_fingerprint=True)): real runs of
tests/support/integrations/lightning_prints.py, one fault each, and compare_losses naming the first thing that
differs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.support.integrations import PRELOAD
from tests.support.launch import launch, together
from torchtitan_rng.compare_losses import main as compare_losses

# The slow tier (CI runs it): the fast suite keeps its time budget; the own loop's runs stand for the recorder there.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                 reason="lightning is not installed (pip install -e '.[lightning]')")]

MODULE = "tests.support.integrations.lightning_prints"
STEPS, STOP_AT = 6, 3
Capture = pytest.CaptureFixture[str]


def _run(out: Path, steps: int, *extra: str) -> None:
    proc = launch([sys.executable, "-m", MODULE, "--out", str(out), "--max-steps", str(steps), *extra],
                  timeout=300, preload=PRELOAD[MODULE])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def _stopped(out: Path, *resume_extra: str) -> None:
    _run(out, STOP_AT)
    _run(out, STEPS, "--resume", str(out / "ckpt" / "last.ckpt"), *resume_extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    names = ("reference", "resumed", "data_seed", "noisy", "clip")
    dumps = {name: tmp_path_factory.mktemp(name) for name in names}
    together(
        lambda: _run(dumps["reference"], STEPS),
        lambda: _stopped(dumps["resumed"]),
        lambda: _run(dumps["data_seed"], STEPS, "--data-seed", "1"),
        lambda: _run(dumps["noisy"], STEPS, "--noisy"),
        lambda: _stopped(dumps["clip"], "--clip", "0.01"),
    )
    return dumps


def _located(runs: dict[str, Path], name: str, capsys: Capture) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = compare_losses([str(runs["reference"]), str(runs[name])])
    lead = "the first tensor that differs: "
    return code, [line[len(lead):] for line in capsys.readouterr().out.splitlines() if line.startswith(lead)]


def test_control_an_exact_resume_names_nothing(runs: dict[str, Path], capsys: Capture) -> None:
    capsys.readouterr()
    assert compare_losses([str(runs["reference"]), str(runs["resumed"])]) == 0
    assert capsys.readouterr().out.splitlines() == [f"identical: {STEPS} steps (1..{STEPS}) with bitwise-equal losses"]
    assert (runs["resumed"] / "tensor_fingerprints" / "rank0.jsonl").is_file()


def test_another_data_order_is_the_data(runs: dict[str, Path], capsys: Capture) -> None:
    code, lines = _located(runs, "data_seed", capsys)
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("step 1, rank 0: the batch of micro-batch 0 differs (`0`, sample(s) "), lines
    assert lines[0].endswith("): the data, not the model"), lines


def test_a_noisy_module_is_named_at_its_output(runs: dict[str, Path], capsys: Capture) -> None:
    code, lines = _located(runs, "noisy", capsys)
    assert code == 1 and lines == ["step 1, rank 0: `body.0` output differs, its input equal (a kernel: an operation "
                                   "inside it gave other bits; its parameters entered the step equal)"], lines


def test_gradient_clip_val_changed_at_the_resume_is_the_update(runs: dict[str, Path], capsys: Capture) -> None:
    code, lines = _located(runs, "clip", capsys)
    assert code == 1 and lines == [
        f"step {STOP_AT + 1}, rank 0: gradients equal, parameter `body.0.weight` after the update differs (the "
        "optimizer: its state or its hyperparameters; the configs differ in trainer.gradient_clip_val 0.05 → 0.01 "
        f"(B's resume entering step {STOP_AT + 1}))"], lines
