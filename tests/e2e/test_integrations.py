"""ExactResumeTrainer (transformers) and ExactResumeCallback (Lightning), real packages on the CPU: a run
stopped mid-epoch and resumed in a fresh process logs every step's loss bit for bit as the uninterrupted
run (losses recorded with float.hex per micro-batch, per rank); the stock frameworks, same script and
stop, differ. Dataset draws from random / numpy / torch in 2 workers; dropout on. The docs' runnable example
runs as the page writes it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.doc_commands import as_repository, block_after, run_block
from tests.support.integrations import PRELOAD
from tests.support.launch import launch, together


def _run(script: str, out: Path, *args: str, nproc: int = 1) -> None:
    """Runs tests/support/integrations/``script``.py as a module, on one process or under torchrun."""
    launcher = [sys.executable, "-m"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "-m"]
    module = f"tests.support.integrations.{script}"
    proc = launch([*launcher, module, "--out", str(out), *args], timeout=300, processes=nproc,
                  preload=PRELOAD[module])
    assert proc.returncode == 0, f"{script} {args} exited {proc.returncode}\n{proc.stderr[-4000:]}"


def _losses(out: Path, nproc: int) -> list[str]:
    return [(out / f"losses_rank{rank}.txt").read_text() for rank in range(nproc)]


def _hf(tmp_path: Path, *common: str, stop: tuple[str, ...], resume: tuple[str, ...], stock: bool = False,
        nproc: int = 1) -> tuple[list[str], list[str]]:
    flags = ("--stock",) if stock else ()

    def stop_and_resume() -> None:
        _run("hf_run", tmp_path / "B", *common, *flags, *stop, nproc=nproc)
        _run("hf_run", tmp_path / "B", *common, *flags, *resume, nproc=nproc)

    together(lambda: _run("hf_run", tmp_path / "A", *common, *flags, nproc=nproc), stop_and_resume)
    return _losses(tmp_path / "A", nproc), _losses(tmp_path / "B", nproc)


HF_ONE = ("--workers", "2", "--ga", "2", "--save-steps", "4")
# 24 samples, batch 2, accumulation 2: 6 optimizer steps an epoch; stopped at 4, run to 8.


@pytest.fixture(scope="module")
def hf_one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[str], list[str]]]:
    """ExactResumeTrainer and the stock Trainer, one process each, side by side: (A's losses, B's losses)."""
    folders = {stock: tmp_path_factory.mktemp("stock" if stock else "exact") for stock in (False, True)}

    def losses(stock: bool) -> tuple[list[str], list[str]]:
        return _hf(folders[stock], *HF_ONE, "--max-steps", "8", stop=("--max-steps", "4"), resume=("--resume",),
                   stock=stock)

    exact, stock = together(lambda: losses(False), lambda: losses(True))
    return {"exact": exact, "stock": stock}


def test_hf_one_process_resumes_bitwise(hf_one_process: dict[str, tuple[list[str], list[str]]]) -> None:
    a, b = hf_one_process["exact"]
    assert len(a[0].splitlines()) == 8 and b == a


def test_hf_stock_trainer_differs(hf_one_process: dict[str, tuple[list[str], list[str]]]) -> None:
    a, b = hf_one_process["stock"]
    assert a[0].splitlines()[:4] == b[0].splitlines()[:4] and b != a


def test_hf_two_processes_sigterm_resumes_bitwise(tmp_path: Path) -> None:
    # Rank 0 alone gets SIGTERM during step 3: both ranks save at step 4 (the vote is read a step later) and
    # stop; 6 steps an epoch.
    a, b = _hf(tmp_path, "--workers", "2", "--max-steps", "8", stop=("--signal-at", "3"), resume=("--resume",),
               nproc=2)
    assert len(b[0].splitlines()) == 8 and a[0] != a[1] and b == a


def _lightning(tmp_path: Path, stop: tuple[str, ...], checkpoint: str, stock: bool = False) -> tuple[list[str], list[str]]:
    common = ("--workers", "2", "--max-steps", "8", *(("--stock",) if stock else ()))

    def stop_and_resume() -> None:
        _run("lightning_run", tmp_path / "B", *common, *stop, nproc=2)
        _run("lightning_run", tmp_path / "B", *common, "--resume", str(tmp_path / "B" / "ckpt" / checkpoint),
             nproc=2)

    together(lambda: _run("lightning_run", tmp_path / "A", *common, nproc=2), stop_and_resume)
    return _losses(tmp_path / "A", 2), _losses(tmp_path / "B", 2)


@pytest.mark.slow  # CI's tier; test_lightning_stops stops DDP ranks by signal every day
def test_lightning_ddp_signal_resumes_bitwise(tmp_path: Path) -> None:
    # The signal during step 3; the ranks' vote on it is read a step later.
    a, b = _lightning(tmp_path, ("--signal-at", "3"), "preempted-step=4.ckpt")
    assert len(b[1].splitlines()) == 8 and b == a


@pytest.mark.slow  # CI's tier; test_lightning_stops stops DDP ranks by signal every day
def test_lightning_stock_differs(tmp_path: Path) -> None:
    a, b = _lightning(tmp_path, ("--save-every", "3", "--max-steps", "3"), "step=3.ckpt", stock=True)
    assert b != a


def test_the_hf_example_runs_as_the_docs_write_it(tmp_path: Path) -> None:
    """docs/integrations.md's runnable example as written, in a folder laid out as the repository: a first
    launch, one stopped by a SIGTERM during step 5, the same command again, and the comparison of the two loss
    logs, exit 0 with the lines the page shows."""
    proc = run_block(block_after("integrations.md", "### A runnable example"), as_repository(tmp_path / "repo"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("stopped by SIGTERM at step 6: checkpoint-6 saved in stopped/checkpoints; "
            "train(resume_from_checkpoint=True) resumes it") in proc.stderr
    assert "preempted (SIGTERM): run the same command again to resume" in proc.stdout.splitlines()
    assert proc.stdout.strip().splitlines()[-1] == "identical: 12 steps (1..12) with bitwise-equal losses"
