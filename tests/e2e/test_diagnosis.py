"""Diagnosis: per-rank RNG fingerprints, the stream that diverged first, the plot, verify_resume, progress."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checks import assert_refused
from tests.support.launch import REPO, compare, run_env, together, train, verify
from torchtitan_rng.loss_log import read_loss_log

STEPS = 8


# Runs that perturb one stream on one rank entering one step: how the diagnosis line naming it ends (None:
# not checked).
PERTURBED = {("torch_cpu", 1, 5): None, ("dataloader", 0, 3): "B holds the state A had entering step 4"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[tuple[str, int, int], Path]]:
    """Run A: two processes, fingerprints on, a progress line every 4 steps; beside it, one run per
    PERTURBED case."""
    dump = tmp_path_factory.mktemp("fingerprinted")
    perturbed = {case: tmp_path_factory.mktemp(f"perturbed_{case[0]}") for case in PERTURBED}
    proc, *_ = together(
        lambda: train(dump, "--training.steps", str(STEPS), "--debug.rng_fingerprint", "--metrics.log_freq", "4",
                      nproc=2),
        *(lambda case=case, out=out: train(out, "--training.steps", str(STEPS), "--debug.rng_fingerprint",
                                           "--debug.perturb_rng", ":".join(map(str, case)), nproc=2)
          for case, out in perturbed.items()))
    return dump, proc.stdout, perturbed


@pytest.fixture(scope="module")
def fingerprinted(runs: tuple[Path, str, dict[tuple[str, int, int], Path]]) -> tuple[Path, str]:
    return runs[0], runs[1]


def test_every_line_has_every_rank_fingerprints(fingerprinted: tuple[Path, str]) -> None:
    records = read_loss_log(fingerprinted[0])
    assert sorted(records) == list(range(1, STEPS + 1))
    for record in records.values():
        ranks = record["rng_fingerprint"]
        assert len(ranks) == 2
        assert all(set(prints) == {"python", "numpy", "torch_cpu", "dataloader"} for prints in ranks)
        # The training streams and data positions are per rank: the fingerprints must tell ranks apart.
        assert ranks[0]["torch_cpu"] != ranks[1]["torch_cpu"]
        assert ranks[0]["dataloader"] != ranks[1]["dataloader"]
    # Dropout draws from torch_cpu every step, so its fingerprint moves from step to step.
    assert records[1]["rng_fingerprint"][0]["torch_cpu"] != records[2]["rng_fingerprint"][0]["torch_cpu"]


@pytest.mark.parametrize(("stream", "rank", "step"), PERTURBED)
def test_deliberate_divergence_is_named(runs: tuple[Path, str, dict[tuple[str, int, int], Path]], stream: str,
                                        rank: int, step: int) -> None:
    fingerprinted, _, perturbed = runs
    behind = PERTURBED[stream, rank, step]
    result = compare(fingerprinted, perturbed[stream, rank, step])
    assert result.returncode == 1, result.stdout
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"first differing step {step}:"), result.stdout
    assert lines[1] == f"random streams first differ entering step {step}:", result.stdout
    # Exactly one stream on one rank differs, and it is the one perturbed.
    named = [line for line in lines if line.startswith("  stream ")]
    assert len(named) == 1 and named[0].startswith(f"  stream {stream} on rank {rank} ("), result.stdout
    if behind is not None:
        assert named[0].endswith(behind), result.stdout


def test_plot_marks_the_divergence(fingerprinted: tuple[Path, str], tmp_path: Path) -> None:
    a = fingerprinted[0]
    b = tmp_path / "b"
    b.mkdir()
    # B: A's log with the loss of step 6 changed in its last bit (a real, tiny divergence).
    lines = (a / "loss_log.jsonl").read_text().splitlines()
    record = read_loss_log(a)[6]
    bumped = math.nextafter(record["loss"], math.inf)
    lines[5] = lines[5].replace(repr(record["loss"]), repr(bumped))
    (b / "loss_log.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "plots" / "cmp.png"
    result = compare(a, b, "--plot", str(out))
    assert result.returncode == 1
    assert result.stdout.startswith("first differing step 6:"), result.stdout
    assert "every random stream matched on every rank entering step 6" in result.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_one_clear_line(fingerprinted: tuple[Path, str], tmp_path: Path) -> None:
    a = fingerprinted[0]
    # A Python where matplotlib cannot be imported (as on a machine without the [plot] extra).
    code = ("import sys; sys.modules['matplotlib'] = None; from torchtitan_rng.compare_losses import main; "
            f"sys.exit(main([{str(a)!r}, {str(a)!r}, '--plot', {str(tmp_path / 'x.png')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=run_env())
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --plot needs matplotlib") and "pip install" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""
    assert not (tmp_path / "x.png").exists()


def test_progress_lines(fingerprinted: tuple[Path, str]) -> None:
    pattern = re.compile(r"step +(\d+)  loss \d+\.\d{6}  lr \d\.\d{3}e[+-]\d\d  [\d,]+ tokens/s  \d+\.\d ms/step  "
                         r"peak rss \d+\.\d\d GiB  eta \d+:\d\d:\d\d$")
    steps = [int(m.group(1)) for line in fingerprinted[1].splitlines() if (m := pattern.search(line))]
    assert steps == [4, 8], fingerprinted[1]


VERIFIED = {  # the checks of verify_resume below, by name: its arguments
    "llama_debug": ("--config", "train_configs/llama_debug.toml", "--steps", "8", "--stop-at", "4"),
    "flux_debug": ("--config", "train_configs/flux_debug.toml", "--steps", "8", "--stop-at", "4"),
    "without_rng_restore": ("--config", "train_configs/llama_debug.toml", "--steps", "8", "--stop-at", "4",
                            "--checkpoint.restore_rng", "false"),
    # Nothing random is carried from step to step there: the resume restores no stream, and must still PASS.
    "world_size_invariant": ("--config", "train_configs/llama_debug.toml", "--steps", "8", "--stop-at", "4",
                             "--parallelism.world_size_invariant", "--training.global_batch_size", "16",
                             "--data.num_workers", "2"),
}


@pytest.fixture(scope="module")
def verified() -> dict[str, subprocess.CompletedProcess]:
    """Each check of VERIFIED (three runs, one process each, one after another), the checks side by side."""
    results = together(*(lambda args=args: verify(*args) for args in VERIFIED.values()))
    return dict(zip(VERIFIED, results))


@pytest.mark.parametrize("config", ["llama_debug", "flux_debug", "world_size_invariant"])
def test_verify_resume_passes(verified: dict[str, subprocess.CompletedProcess], config: str) -> None:
    proc = verified[config]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("PASS: identical: 8 steps (1..8) with bitwise-equal losses")


def test_verify_resume_fails_without_rng_restore(verified: dict[str, subprocess.CompletedProcess]) -> None:
    proc = verified["without_rng_restore"]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "FAIL: first differing step 5:" in out, out
    assert "random streams first differ entering step 5:" in out
    # Without the restore, the resumed run starts from the fresh seed: the diagnosis says so.
    assert re.search(r"stream torch_cpu on rank 0 \(A \w+, B \w+\): B holds the state A had entering step 1$", out, re.M), out


def test_invariant_mode_names_a_skipped_batch_and_refuses_disturbing_a_stream(tmp_path: Path) -> None:
    """World-size-invariant training seeds the streams per micro-batch: its fingerprints are the streams of
    the step's first micro-batch and the batch sampler's position. A skipped batch is still named; disturbing
    a global stream entering a step would change nothing, and is refused in one line."""
    common = ("--parallelism.world_size_invariant", "--training.global_batch_size", "16", "--data.num_workers", "2",
              "--training.steps", "4", "--debug.rng_fingerprint")
    reference, skipped = tmp_path / "A", tmp_path / "skipped"
    together(lambda: train(reference, *common),
             lambda: train(skipped, *common, "--debug.perturb_rng", "dataloader:0:3"))
    lines = compare(reference, skipped).stdout.splitlines()
    assert lines[0].startswith("first differing step 3:") and lines[1] == "random streams first differ entering step 3:"
    assert [line for line in lines if line.startswith("  stream ")][0].startswith("  stream dataloader on rank 0 (")
    refused = train(tmp_path / "stream", *common, "--debug.perturb_rng", "torch_cpu:0:3", check=False)
    assert_refused(refused, "every micro-batch seeds the streams anew, so it would change nothing")


def test_perturbing_a_stream_the_run_lacks_is_refused(tmp_path: Path) -> None:
    proc = train(tmp_path, "--debug.perturb_rng", "device:0:3", check=False, env={"TORCHTITAN_RNG_DEVICE": "cpu"})
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: config debug.perturb_rng names the device stream, but this run is on "
                                   "the CPU (its device stream is torch_cpu)")
    assert not (tmp_path / "loss_log.jsonl").exists()
