"""Runs that several e2e files compare against or start from; read-only, so one run per session serves them all."""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.launch import STEP2, train


@pytest.fixture
def sigint_raises_in_children() -> Iterator[None]:
    """A suite started in the background ignores SIGINT, and so would the runs it starts (an ignored signal
    stays ignored across exec); a handler of ours is reset to the default in a child instead."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


# The uninterrupted debug runs (run A of the promise).
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
