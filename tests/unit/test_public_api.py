"""The public surface: a light import, every name documented and typed, the API's one-line refusals, and
an in-process resume through ExactResume and build_dataloader."""

from __future__ import annotations

import ast
import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchtitan_rng
from tests.support.launch import REPO, run_env


def test_import_is_light() -> None:
    code = "import sys, torchtitan_rng; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=run_env())
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_every_public_name_resolves_is_documented_and_typed() -> None:
    api_doc = (REPO / "docs" / "api.md").read_text()
    for name in torchtitan_rng.__all__:
        value = getattr(torchtitan_rng, name)
        doc = (value.__doc__ or "").strip()
        assert doc and not doc.startswith(f"{name}("), f"{name} has no docstring of its own"
        assert f"`{name}" in api_doc, f"{name} is missing from docs/api.md"
    # The TYPE_CHECKING imports (for editors and type checkers) name exactly the exported names.
    tree = ast.parse((REPO / "torchtitan_rng" / "__init__.py").read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    typed = {alias.name for node in block.body for alias in node.names}
    assert typed == set(torchtitan_rng.__all__)


class GlobalNoise(torch.utils.data.Dataset):
    """A user's dataset that draws from the global torch RNG in __getitem__ (here: in a worker)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> torch.Tensor:
        return index + torch.rand(())


def test_restore_after_a_step_is_refused(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    exact = torchtitan_rng.ExactResume(tmp_path, model=model, interval=1, seed=0)
    exact.maybe_save(1, last_step=3)
    with pytest.raises(torchtitan_rng.RestoreOrderError, match="after step 1 ran"):
        exact.restore_rng()


def test_plain_dataloader_is_refused(tmp_path: Path) -> None:
    loader = DataLoader(TensorDataset(torch.arange(4)), batch_size=2)
    with pytest.raises(TypeError, match="build it with torchtitan_rng.build_dataloader"):
        torchtitan_rng.ExactResume(tmp_path, model=nn.Linear(2, 2), dataloader=loader, interval=1)  # type: ignore[arg-type]


def test_in_process_resume_restores_streams_position_and_worker_rng(tmp_path: Path) -> None:
    """Save at a step boundary, start over in fresh objects with other streams: the next batch (position and
    the worker's global-RNG noise) and the next main-process draw are the uninterrupted ones."""
    def build() -> tuple[torchtitan_rng.ExactResume, torchtitan_rng.ResumableDataLoader]:
        loader = torchtitan_rng.build_dataloader(GlobalNoise(), batch_size=3, seed=5, num_workers=1)
        return torchtitan_rng.ExactResume(tmp_path, model=nn.Linear(2, 2), dataloader=loader, interval=2, seed=5), loader

    exact, loader = build()
    assert exact.load() == 0  # a fresh run: load() comes first all the same
    batches = iter(loader)
    exact.restore_rng()
    next(batches), next(batches)
    exact.maybe_save(2, last_step=4)
    expected_batch, expected_draw = next(batches), torch.rand(4)
    # Its worker ends now: left to the garbage collector, an iterator's workers take seconds to give up.
    exact.close()
    del batches

    torch.manual_seed(123)  # another process's streams
    exact, loader = build()
    with exact:
        assert exact.load() == 2
        batches = iter(loader)
        assert exact.restore_rng() is True
        assert torch.equal(next(batches), expected_batch)
        assert torch.equal(torch.rand(4), expected_draw)


def _workers_of_a_dropped_loop(folder: Path) -> list[int]:
    """A loop that iterates a 2-worker loader and returns without close(): its workers' pids."""
    model = nn.Linear(2, 2)
    loader = torchtitan_rng.build_dataloader(GlobalNoise(), batch_size=2, seed=0, num_workers=2)
    exact = torchtitan_rng.ExactResume(folder, model=model, dataloader=loader, interval=100, seed=0)
    exact.load()
    batches = iter(loader)
    next(batches)
    return [worker.pid for worker in batches.inner._workers]


def test_loop_dropped_without_close_ends_its_workers_at_once(tmp_path: Path) -> None:
    """Nothing holds the loop in a reference cycle: dropped, its workers end then and there. Left to the cyclic
    collector, they would outlive it and then wait out a 5 s timeout each."""
    gc.disable()  # only reference counting frees the loop
    try:
        pids = _workers_of_a_dropped_loop(tmp_path)
        alive = [pid for pid in pids if _exists(pid)]
    finally:
        gc.enable()
    assert len(pids) == 2 and alive == []


def _exists(pid: int) -> bool:
    """Whether the process is still there (a worker that was joined is gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
