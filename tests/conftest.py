"""Where a test lives says what it is: tests/unit runs in this process (the fast subset, ``-m "not e2e"``),
tests/e2e starts training processes, several processes or installs the package (marked e2e here, by folder);
tests/support holds what both import."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.token_data import write_jsonl, write_token_file

TESTS = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = item.path.relative_to(TESTS).parts[0]
        if folder == "e2e":
            item.add_marker(pytest.mark.e2e)
        elif folder != "unit":
            raise pytest.UsageError(f"{item.nodeid}: a test belongs in tests/unit or tests/e2e")
        elif item.get_closest_marker("e2e"):
            raise pytest.UsageError(f"{item.nodeid} is marked e2e: move it to tests/e2e")


@pytest.fixture(scope="session")
def token_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A .bin token file and a .jsonl file of documents (tests/support/token_data.py); read-only."""
    folder = tmp_path_factory.mktemp("token_files")
    return {"bin": write_token_file(folder / "train.bin"), "jsonl": write_jsonl(folder / "docs.jsonl")}
