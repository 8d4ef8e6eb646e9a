"""Run only by test_module_runs_once.py (not a test_*.py file, so the suite does not collect it): a module-scoped
fixture that writes the pytest worker that made it to the file ``MODULE_RUNS_PROBE`` names, used by parametrized
tests beside tests that use nothing."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def runs() -> str:
    with open(os.environ["MODULE_RUNS_PROBE"], "a", encoding="utf-8") as file:
        file.write(os.environ.get("PYTEST_XDIST_WORKER", "") + "\n")
    return "made"


@pytest.mark.parametrize("case", range(6))
def test_uses_the_runs(runs: str, case: int) -> None:
    assert runs == "made"


@pytest.mark.parametrize("case", range(6))
def test_uses_nothing(case: int) -> None:
    pass
