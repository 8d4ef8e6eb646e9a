"""The tests that share a module's runs (a module-scoped fixture) go to one pytest worker under the suite's
``--dist loadgroup`` (tests/conftest.py), so those runs are made once, not once per worker that gets one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.launch import REPO, run_env


def test_a_module_fixture_is_made_by_one_worker(tmp_path: Path) -> None:
    made = tmp_path / "made"
    made.touch()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", "tests/e2e/module_runs_probe.py"], cwd=REPO, capture_output=True, text=True,
                          env=run_env({"MODULE_RUNS_PROBE": str(made)}), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "12 passed" in proc.stdout, proc.stdout[-3000:]
    assert len(made.read_text().splitlines()) == 1, made.read_text()
