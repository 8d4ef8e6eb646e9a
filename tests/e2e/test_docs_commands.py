"""The docs' examples run as written: each block below, copied from its page, runs to its end (exit 0) in a
folder laid out as the repository, and says what the page says it does. The integration page's example:
tests/e2e/test_integrations.py; the cluster recipes: tests/e2e/test_cluster_recipes.py."""

from __future__ import annotations

from pathlib import Path

from tests.support.doc_commands import as_repository, block_after, run_block
from tests.support.launch import together


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
