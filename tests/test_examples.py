"""Every example resumes exactly through the public API, and each one's control (the API's RNG restore
left out) is caught; plus the public surface itself: light import, documented names, one-line errors."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchtitan_rng
from launch import REPO, compare, run_env, stop_and_resume, train
from torchtitan_rng.compare_losses import same_bits
from torchtitan_rng.loss_log import read_loss_log

EXAMPLES = REPO / "examples"
PLUGIN_CONFIG = EXAMPLES / "plugin" / "noisy_sine.toml"


def with_path(*folders: Path) -> dict[str, str]:
    """PYTHONPATH for a subprocess: ``folders`` first (the repo: nothing is pip-installed in tests)."""
    return {"PYTHONPATH": os.pathsep.join([*map(str, folders), os.environ.get("PYTHONPATH", "")])}


def run_example(script: str, *args: str, nproc: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    """``python examples/SCRIPT`` or, for several processes, the same under torchrun."""
    path = str(EXAMPLES / script)
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    proc = subprocess.run([*launcher, path, *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=run_env(with_path(REPO)))
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def resume_from_copy(source: Path, step: int, dest: Path) -> None:
    """A fresh output folder holding only ``source``'s checkpoint of ``step`` (the stopped run's state)."""
    shutil.copytree(source / "checkpoint" / f"step-{step}", dest / "checkpoint" / f"step-{step}")


def assert_first_difference(a: Path, b: Path, step: int) -> None:
    result = compare(a, b, "--only-common-steps")
    assert result.returncode == 1, result.stdout
    assert result.stdout.startswith(f"first differing step {step}:"), result.stdout


# --- Example 1: a plain DDP loop (2 processes, gloo), stopped mid-epoch and resumed ----------------------

DDP_STEPS, DDP_STOP = 14, 9  # 6 steps per epoch: the stop is in the second epoch


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    uninterrupted, resumed = tmp_path_factory.mktemp("ddp_A"), tmp_path_factory.mktemp("ddp_B")
    run_example("ddp_exact_resume.py", "--out", str(uninterrupted), "--steps", str(DDP_STEPS), nproc=2)
    run_example("ddp_exact_resume.py", "--out", str(resumed), "--steps", str(DDP_STOP), nproc=2)
    run_example("ddp_exact_resume.py", "--out", str(resumed), "--steps", str(DDP_STEPS), nproc=2)
    return uninterrupted, resumed


def test_ddp_example_resumes_exactly(ddp_runs: tuple[Path, Path]) -> None:
    uninterrupted, resumed = ddp_runs
    result = compare(uninterrupted, resumed)
    assert result.returncode == 0, result.stdout
    assert sorted(read_loss_log(resumed)) == list(range(1, DDP_STEPS + 1))
    assert sorted(p.name for p in (resumed / "checkpoint").iterdir()) == ["step-12", "step-14", "step-4", "step-8", "step-9"]


def test_ddp_example_control_differs(ddp_runs: tuple[Path, Path], tmp_path: Path) -> None:
    uninterrupted, resumed = ddp_runs
    resume_from_copy(resumed, DDP_STOP, tmp_path)
    run_example("ddp_exact_resume.py", "--out", str(tmp_path), "--steps", str(DDP_STEPS), "--control", nproc=2)
    assert_first_difference(uninterrupted, tmp_path, DDP_STOP + 1)


# --- Example 2: the restore-order experiment of seed 001 --------------------------------------------------

ORDER_STEPS, ORDER_STOP = 6, 3


@pytest.fixture(scope="module")
def order_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    uninterrupted, resumed = tmp_path_factory.mktemp("order_A"), tmp_path_factory.mktemp("order_B")
    run_example("restore_order.py", "--out", str(uninterrupted), "--steps", str(ORDER_STEPS))
    run_example("restore_order.py", "--out", str(resumed), "--steps", str(ORDER_STOP))
    run_example("restore_order.py", "--out", str(resumed), "--steps", str(ORDER_STEPS))
    return uninterrupted, resumed


def test_restore_order_example_resumes_exactly(order_runs: tuple[Path, Path]) -> None:
    uninterrupted, resumed = order_runs
    result = compare(uninterrupted, resumed)
    assert result.returncode == 0, result.stdout
    a, b = read_loss_log(uninterrupted), read_loss_log(resumed)
    assert all(same_bits(a[step]["output_sum"], b[step]["output_sum"]) for step in a)


def test_restore_after_fetching_is_refused(order_runs: tuple[Path, Path], tmp_path: Path) -> None:
    """Trainer's order (fetch the first resumed batch, then restore) stops with one clear line."""
    resume_from_copy(order_runs[1], ORDER_STOP, tmp_path)
    proc = run_example("restore_order.py", "--out", str(tmp_path), "--steps", str(ORDER_STEPS),
                       "--order", "get_first", check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "torchtitan_rng.own_loop.RestoreOrderError: restore_rng() was called after the dataloader yielded 1 "
        "batch(es) of this run; call it after iter(dataloader) and before the first batch is fetched"
    )
    assert not (tmp_path / "loss_log.jsonl").exists()  # no step was trained on the wrong batch


def test_restore_order_control_differs(order_runs: tuple[Path, Path], tmp_path: Path) -> None:
    uninterrupted, resumed = order_runs
    resume_from_copy(resumed, ORDER_STOP, tmp_path)
    run_example("restore_order.py", "--out", str(tmp_path), "--steps", str(ORDER_STEPS), "--control")
    assert_first_difference(uninterrupted, tmp_path, ORDER_STOP + 1)


# --- Example 3: a model and dataset from outside the package, trained by run_train.sh --------------------

PLUGIN_STEPS, PLUGIN_STOP = 12, 6
PLUGIN_ENV = with_path(EXAMPLES / "plugin")


@pytest.fixture(scope="module")
def plugin_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    uninterrupted, resumed = tmp_path_factory.mktemp("plugin_A"), tmp_path_factory.mktemp("plugin_B")
    train(uninterrupted, "--training.steps", str(PLUGIN_STEPS), config=PLUGIN_CONFIG, env=PLUGIN_ENV,
          via_run_train=True)
    stop_and_resume(resumed, PLUGIN_STOP, PLUGIN_STEPS, config=PLUGIN_CONFIG, env=PLUGIN_ENV, via_run_train=True)
    return uninterrupted, resumed


def test_plugin_example_resumes_exactly(plugin_runs: tuple[Path, Path]) -> None:
    uninterrupted, resumed = plugin_runs
    result = compare(uninterrupted, resumed)
    assert result.returncode == 0, result.stdout
    assert sorted(read_loss_log(resumed)) == list(range(1, PLUGIN_STEPS + 1))


def test_plugin_control_differs(plugin_runs: tuple[Path, Path], tmp_path: Path) -> None:
    uninterrupted, resumed = plugin_runs
    resume_from_copy(resumed, PLUGIN_STOP, tmp_path)
    train(tmp_path, "--checkpoint.enable", "--lr_scheduler.total_steps", str(PLUGIN_STEPS),
          "--checkpoint.restore_rng", "false", config=PLUGIN_CONFIG, env=PLUGIN_ENV, via_run_train=True)
    assert_first_difference(uninterrupted, tmp_path, PLUGIN_STOP + 1)


def one_line_exit_2(proc: subprocess.CompletedProcess) -> str:
    """The single line a refused run printed (exit 2, nothing else, no traceback)."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def registered_names(line: str, pattern: str) -> set[str]:
    match = re.fullmatch(pattern, line)
    assert match, line
    return set(match.group(1).split(", "))


def test_unknown_model_name_is_one_line(tmp_path: Path) -> None:
    proc = train(tmp_path, "--model.name", "noisy_cosine", config=PLUGIN_CONFIG, env=PLUGIN_ENV,
                 via_run_train=True, check=False)
    names = registered_names(one_line_exit_2(proc), re.escape("error: unknown model.name 'noisy_cosine'; registered: ")
                             + r"(.*)" + re.escape(" (job.custom_module 'my_pkg.my_spec' did not register it)"))
    assert {"llama", "noisy_sine"} <= names


def test_custom_module_not_found_is_one_line(tmp_path: Path) -> None:
    proc = train(tmp_path, "--job.custom_module", "my_pkg.my_spek", config=PLUGIN_CONFIG, env=PLUGIN_ENV,
                 via_run_train=True, check=False)
    names = registered_names(one_line_exit_2(proc), re.escape(
        "error: job.custom_module 'my_pkg.my_spek' not found: no module 'my_pkg.my_spek' on the Python path "
        "(put the folder that holds it on PYTHONPATH); registered model names: ") + r"(.*)")
    assert "llama" in names and "noisy_sine" not in names


def test_custom_module_that_raises_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "broken_spec.py").write_text("import math\nraise RuntimeError('no data in /nowhere\\nsee above')\n")
    proc = train(tmp_path / "run", "--job.custom_module", "broken_spec", config=PLUGIN_CONFIG,
                 env=with_path(tmp_path), via_run_train=True, check=False)
    assert one_line_exit_2(proc) == ("error: job.custom_module 'broken_spec' failed to import: RuntimeError: "
                                     "no data in /nowhere (broken_spec.py:2)")
    assert not (tmp_path / "run").exists()


# --- The public API itself ---------------------------------------------------------------------------------


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


class KeyEcho(torchtitan_rng.SampleRandomDataset):
    def __init__(self) -> None:
        super().__init__(0, "echo")

    def __len__(self) -> int:
        return 10

    def __getitem__(self, key: int) -> int:
        return key


def test_loader_hands_indices_or_sample_keys() -> None:
    """A plain dataset gets indices in range(len) in every epoch; a SampleRandomDataset gets sample keys."""
    batches = iter(torchtitan_rng.build_dataloader(TensorDataset(torch.arange(10)), batch_size=5, seed=0))
    epochs = [torch.cat([next(batches)[0], next(batches)[0]]) for _ in range(3)]
    for seen in epochs:
        assert torch.equal(seen.sort().values, torch.arange(10))
    assert not torch.equal(epochs[0], epochs[1])  # a new permutation each epoch
    keys = iter(torchtitan_rng.build_dataloader(KeyEcho(), batch_size=5, seed=0))
    second_epoch = torch.cat([next(keys) for _ in range(4)][2:])
    assert torch.equal(second_epoch.sort().values, torch.arange(10, 20))


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
    del batches

    torch.manual_seed(123)  # another process's streams
    exact, loader = build()
    assert exact.load() == 2
    batches = iter(loader)
    assert exact.restore_rng() is True
    assert torch.equal(next(batches), expected_batch)
    assert torch.equal(torch.rand(4), expected_draw)
