"""The tensor locator in the HF Trainer and Lightning integrations (``ExactResumeTrainer(...,
tensor_fingerprint=True)``, ``ExactResumeCallback(tensor_fingerprint=True)``): real runs of
tests/support/integrations/hf_prints.py and lightning_prints.py, one fault each, and compare_losses naming the
first thing that differs."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.integrations import PRELOAD
from tests.support.launch import launch, together
from torchtitan_rng.compare_losses import main as compare_losses
from torchtitan_rng.diagnosis.locator import prints_path

# The slow tier (CI runs it): the fast suite keeps its time budget; the own loop's runs stand for the recorder there.
pytestmark = pytest.mark.slow

STEPS, STOP_AT = 6, 3
Capture = pytest.CaptureFixture[str]


@dataclass(frozen=True)
class Integration:
    package: str  # what the runs need installed
    module: str  # the training script
    batch_entry: str  # how the locator names the batch's input
    update_flags: tuple[str, ...]  # the resume's changed clipping
    update_key: str  # how the config diff names it
    resumes_from: str  # the flag and, below the run's folder, what a resume starts from ("" : the script finds it)
    reference_saves_at_stop: bool  # whether the uninterrupted run saves (and so hashes its optimizer state) there


INTEGRATIONS = {
    "hf": Integration("transformers", "tests.support.integrations.hf_prints", "x", ("--max-grad-norm", "0.01"),
                      "args.max_grad_norm", "", True),
    "lightning": Integration("lightning", "tests.support.integrations.lightning_prints", "0", ("--clip", "0.01"),
                             "trainer.gradient_clip_val", "ckpt/last.ckpt", False),
}


def _run(integration: Integration, out: Path, steps: int, *extra: str) -> None:
    proc = launch([sys.executable, "-m", integration.module, "--out", str(out), "--max-steps", str(steps), *extra],
                  timeout=300, preload=PRELOAD[integration.module])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def _stopped(integration: Integration, out: Path, *resume_extra: str) -> None:
    _run(integration, out, STOP_AT)
    resume = ("--resume", str(out / integration.resumes_from)) if integration.resumes_from else ()
    _run(integration, out, STEPS, *resume, *resume_extra)


@pytest.fixture(scope="module", params=list(INTEGRATIONS))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Integration,
                                                                                           dict[str, Path]]:
    integration = INTEGRATIONS[request.param]
    if importlib.util.find_spec(integration.package) is None:
        pytest.skip(f"{integration.package} is not installed (pip install -e '.[{request.param}]')")
    dumps = {name: tmp_path_factory.mktemp(f"{request.param}_{name}")
             for name in ("reference", "resumed", "data_seed", "noisy", "update")}
    together(
        lambda: _run(integration, dumps["reference"], STEPS),
        lambda: _stopped(integration, dumps["resumed"]),
        lambda: _run(integration, dumps["data_seed"], STEPS, "--data-seed", "1"),
        lambda: _run(integration, dumps["noisy"], STEPS, "--noisy"),
        lambda: _stopped(integration, dumps["update"], *integration.update_flags),
    )
    return integration, dumps


def _located(dumps: dict[str, Path], name: str, capsys: Capture) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = compare_losses([str(dumps["reference"]), str(dumps[name])])
    lead = "the first tensor that differs: "
    return code, [line[len(lead):] for line in capsys.readouterr().out.splitlines() if line.startswith(lead)]


def test_control_an_exact_resume_names_nothing(runs: tuple[Integration, dict[str, Path]], capsys: Capture) -> None:
    _, dumps = runs
    capsys.readouterr()
    assert compare_losses([str(dumps["reference"]), str(dumps["resumed"])]) == 0
    assert capsys.readouterr().out.splitlines() == [f"identical: {STEPS} steps (1..{STEPS}) with bitwise-equal losses"]
    assert (dumps["resumed"] / "tensor_fingerprints" / "rank0.jsonl").is_file()


def test_another_data_order_is_the_data(runs: tuple[Integration, dict[str, Path]], capsys: Capture) -> None:
    integration, dumps = runs
    code, lines = _located(dumps, "data_seed", capsys)
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"step 1, rank 0: the batch of micro-batch 0 differs (`{integration.batch_entry}`, "
                               "sample(s) "), lines
    assert lines[0].endswith("): the data, not the model"), lines


def test_a_noisy_module_is_named_at_its_output(runs: tuple[Integration, dict[str, Path]], capsys: Capture) -> None:
    code, lines = _located(runs[1], "noisy", capsys)
    assert code == 1 and lines == ["step 1, rank 0: `body.0` output differs, its input equal (a kernel: an operation "
                                   "inside it gave other bits; its parameters entered the step equal)"], lines


def test_clipping_changed_at_the_resume_is_the_update(runs: tuple[Integration, dict[str, Path]],
                                                      capsys: Capture) -> None:
    integration, dumps = runs
    code, lines = _located(dumps, "update", capsys)
    state = ("the optimizer state equal where last compared, entering this step" if integration.reference_saves_at_stop
             else f"the optimizer state B's resume loaded not compared: A hashed none after step {STOP_AT} (it is "
                  "hashed where a process starts and at saves)")
    assert code == 1 and lines == [
        f"step {STOP_AT + 1}, rank 0: gradients equal, parameter `body.0.weight` after the update differs (the "
        f"optimizer: its state or its hyperparameters; the configs differ in {integration.update_key} 0.05 → 0.01 "
        f"(B's resume entering step {STOP_AT + 1}); {state})"], lines


def test_the_optimizer_state_is_hashed_at_each_save(runs: tuple[Integration, dict[str, Path]]) -> None:
    """At the stop's save (Lightning's save_last comes after the callbacks' on_train_end) and at the resume: the
    state B saved and the state it loaded, hashed. Control: a step without a save has none."""
    lines = {}
    for line in prints_path(runs[1]["resumed"], 0).read_text().splitlines():
        record = json.loads(line)
        lines[record["step"]] = record  # a step written twice counts by its later line
    assert lines[STOP_AT].get("optim") and lines[STOP_AT + 1]["entering"]["optim"], lines[STOP_AT].keys()
    assert lines[STOP_AT]["optim"] == lines[STOP_AT + 1]["entering"]["optim"]  # what was saved is what was loaded
    assert "optim" not in lines[STOP_AT - 1]
