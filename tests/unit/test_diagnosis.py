"""Diagnosis without training runs: the diagnosis of logs without fingerprints, verify_resume's bad input."""

from __future__ import annotations

import pytest

from tests.support.launch import verify
from torchtitan_rng.diagnosis.divergence import diagnose


def test_diagnosis_without_fingerprints_or_outside_the_streams() -> None:
    plain = {1: {"step": 1, "loss": 1.0}, 2: {"step": 2, "loss": 2.0}}
    assert diagnose(plain, plain, 2)[0].startswith("no RNG fingerprints in A and B: run both with --debug.rng_fingerprint")
    prints = {"rng_fingerprint": [{"torch_cpu": "aa", "dataloader": "bb"}]}
    a = {1: {"step": 1, "loss": 1.0, **prints}}
    b = {1: {"step": 1, "loss": 1.5, **prints}}
    assert diagnose(a, b, 1)[0].startswith("every random stream matched on every rank entering step 1")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "8", "--stop-at", "8"], "error: --stop-at 8 must be below --steps 8"),
        (["--steps", "8", "--stop-at", "4", "--training.nope", "1"], "error: unknown config key 'training.nope'"),
        (["--steps", "8", "--stop-at", "4", "--debug.perturb_rng", "dice:0:1"], "error: config debug.perturb_rng = 'dice:0:1' is not valid"),
    ],
)
def test_verify_resume_bad_input(args: list[str], message: str) -> None:
    proc = verify("--config", "train_configs/llama_debug.toml", *args)
    assert proc.returncode == 2
    assert proc.stderr.startswith(message) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
