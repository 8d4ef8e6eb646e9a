"""The docs' examples run as written: each block below, copied from its page, runs to its end (exit 0) in a
folder laid out as the repository, and says what the page says it does. The integration page's example:
tests/e2e/test_integrations.py; the cluster recipes: tests/e2e/test_cluster_recipes.py; docs/torchtitan.md's
commands for accelerators, parsed by torchtitan's own parser: tests/unit/test_torchtitan_page.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.doc_commands import as_repository, block_after, run_block
from tests.support.launch import REPO, compare, together


@pytest.mark.slow  # CI's tier: each block runs a 2-process training
def test_the_docs_examples_run_as_written(tmp_path: Path) -> None:
    """docs/world_size_invariant.md: a 2-process world-size-invariant run, three of its steps again on one process from its
    checkpoint (looking only), compared: identical. docs/spikes.md: the token file written, a 2-process ordinary
    run on it, and its step 7 replayed at its own count by default: equal bit for bit."""
    folders = {name: as_repository(tmp_path / name) for name in ("replay", "spikes")}
    replayed, spiked = together(
        lambda: run_block(block_after("world_size_invariant.md", "## Example"), folders["replay"], processes=2),
        lambda: run_block(block_after("spikes.md", "`train.bin` is a file"), folders["spikes"], processes=2))
    assert replayed.returncode == 0, replayed.stdout[-3000:] + replayed.stderr[-3000:]
    assert replayed.stdout.strip().splitlines()[-1] == "identical: 3 steps (6..8) with bitwise-equal losses"
    assert not (folders["replay"] / "replay" / "checkpoint").exists()  # it only looked
    assert spiked.returncode == 0, spiked.stdout[-3000:] + spiked.stderr[-3000:]
    lines = spiked.stdout.strip().splitlines()
    assert "replayed step 7 of run on 2 process(es) from checkpoint run/checkpoint/step-5" in lines
    assert lines[-1].startswith("step 7: loss ") and lines[-1].endswith("equal to the run's loss log bit for bit")


# docs/torchtitan.md's CPU trial (examples/torchtitan_cpu), llama and Flux: write the assets, train 4 steps, train
# 2 and resume to 4, compare. Its python and torchrun fork from a server that has imported torchtitan (as the
# plug-in's own tests do): a cold torchtitan import costs seconds per process. Both blocks are in the slow tier,
# which CI runs; tests/e2e/test_torchtitan_plugin.py trains the same tiny llama every day.
TORCHTITAN_CPU = {"llama": "### On a CPU first", "flux": "Flux, the same way:"}
TORCHTITAN_WARM = (str(REPO / "examples" / "torchtitan_cpu" / "train.py"), "torchtitan.models.flux.trainer")
IDENTICAL = "identical: 4 steps (1..4) with bitwise-equal losses"


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                    reason="torchtitan is not installed (pip install -e '.[torchtitan]')")
@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "flux"])
def test_the_torchtitan_cpu_trial_runs_as_written(tmp_path: Path, model: str) -> None:
    """The stopped run saved at 2, resumed there, and compared identical with the uninterrupted run, every run
    plugged in; control: the same comparison catches one loss changed in its last bit."""
    folder = as_repository(tmp_path / "repo")
    proc = run_block(block_after("torchtitan.md", TORCHTITAN_CPU[model]), folder, processes=2,
                     env={"HF_HOME": str(tmp_path / "hf_home")}, warm=TORCHTITAN_WARM)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert proc.stdout.strip().splitlines()[-1] == IDENTICAL, proc.stdout[-2000:]
    assert out.count("[Override] torchtitan_rng.integrations.torchtitan.exact_resume: checkpoint") >= 3, out[-3000:]
    assert "Training starts at step 3" in out
    uninterrupted, stopped = (folder / "outputs" / f"{model}_{run}" for run in ("a", "b"))
    assert sorted(path.name for path in (stopped / "checkpoint").iterdir()) == ["step-2", "step-4"]
    changed = tmp_path / "changed"
    changed.mkdir()
    lines = [json.loads(line) for line in (stopped / "loss_log.jsonl").read_text().splitlines()]
    for line in lines:
        if line["step"] == 3:  # the next float32: the loss changed in its last bit
            line["loss"] = float(np.nextafter(np.float32(line["loss"]), np.float32(np.inf)))
    (changed / "loss_log.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    control = compare(uninterrupted, changed)
    assert control.returncode == 1 and control.stdout.startswith("first differing step 3:"), control.stdout
