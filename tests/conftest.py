"""Where a test lives says what it is: tests/unit runs in this process (the fast subset, ``-m "not e2e"``),
tests/e2e starts training processes, several processes or installs the package (marked e2e here, by folder);
tests/support holds what both import."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.token_data import write_jsonl, write_token_file

TESTS = Path(__file__).resolve().parent


# The files whose runs take longest (the launch record, docs/testing.md), started first so that the workers
# end together; a file not named here keeps its place. A scheduling hint: a wrong one costs only time.
START_FIRST = ("test_training_features.py", "test_torchtitan_plugin.py", "test_torchtitan_layouts.py",
               "test_world_size_invariant.py", "test_hf_stops.py", "test_lightning_stops.py", "test_integrations.py",
               "test_resume_flux.py", "test_pipeline_invariant.py", "test_spikes.py", "test_diagnosis.py")


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
        if item.config.pluginmanager.hasplugin("xdist") and _uses_module_runs(item):
            # pytest-xdist (--dist loadgroup) keeps the tests that share a module's runs on one worker, which
            # makes those runs once; the other tests go to whichever worker is free.
            item.add_marker(pytest.mark.xdist_group(item.path.name))
    rank = {name: index for index, name in enumerate(START_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def _uses_module_runs(item: pytest.Item) -> bool:
    fixtures = getattr(item, "_fixtureinfo", None)
    return fixtures is not None and any(definition.scope == "module"
                                        for definitions in fixtures.name2fixturedefs.values()
                                        for definition in definitions)


@pytest.fixture(scope="session")
def token_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A .bin token file and a .jsonl file of documents (tests/support/token_data.py); read-only."""
    folder = tmp_path_factory.mktemp("token_files")
    return {"bin": write_token_file(folder / "train.bin"), "jsonl": write_jsonl(folder / "docs.jsonl")}
