import sys
from pathlib import Path

# The tests import their launch helpers as a plain module.
sys.path.insert(0, str(Path(__file__).resolve().parent))


import shutil  # noqa: E402

import pytest  # noqa: E402

from launch import STEP2, train  # noqa: E402


# The uninterrupted debug runs (run A of the promise) that several test files compare against; read-only,
# so one run per session serves them all.
@pytest.fixture(scope="session")
def llama_uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dump = tmp_path_factory.mktemp("llama_A")
    train(dump)
    return dump


@pytest.fixture(scope="session")
def llama_uninterrupted_two_processes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dump = tmp_path_factory.mktemp("llama_A_2proc")
    train(dump, nproc=2)
    return dump


@pytest.fixture(scope="session")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's dump folder: loss log and a complete checkpoint at step 2 from one process."""
    dump = tmp_path_factory.mktemp("saved")
    train(dump, "--training.steps", "2", *STEP2)
    return dump


@pytest.fixture
def user_dump(saved: Path, tmp_path: Path) -> Path:
    dump = tmp_path / "dump"
    shutil.copytree(saved, dump)
    return dump
