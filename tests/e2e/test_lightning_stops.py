"""ExactResumeCallback under torchrun (2 processes, gloo, 2 loader workers each, accumulation 2, validation
every 3 optimizer steps that draws from the global streams): a SIGTERM to the launcher, to every rank, to
rank 0 alone, or in the middle of an accumulation window saves ``preempted-step=N.ckpt`` at one agreed
step, with no hang; checkpoints taken at a validation step (the callback's, ModelCheckpoint's, a user's
stop callback's) resume bitwise; signal handling lasts only as long as fit().

One uninterrupted run saves every step; a checkpoint is shown exact by resuming it (for a validation step
and a launcher SIGTERM) or by being equal, tensor bit for tensor bit, to the uninterrupted run's checkpoint
of the same step (whose resume is shown exact)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.checks import assert_same_tensors
from tests.support.integrations import PRELOAD
from tests.support.launch import REPO, launch, run_env, together

SCRIPT = "tests.support.integrations.lightning_run"
STEPS = 6
# Validation every 6 batches = every 3 optimizer steps (accumulation 2): steps 3 and 6 are validation steps.
COMMON = ("--workers", "2", "--ga", "2", "--val-every", "6", "--max-steps", str(STEPS))
TIMEOUT = 240  # a hang fails the test instead of the suite


def _command(out: Path, *args: str, nproc: int = 2) -> list[str]:
    launcher = [sys.executable, "-m"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "-m"]
    return [*launcher, SCRIPT, "--out", str(out), *args]


def _env() -> dict[str, str]:
    return run_env()


def _run(out: Path, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    return launch(_command(out, *args, nproc=nproc), env=_env(), timeout=TIMEOUT, processes=nproc,
                  preload=PRELOAD[SCRIPT])


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"{' '.join(proc.args)} exited {proc.returncode}\n{proc.stderr[-4000:]}"
    return proc


def _signalled(out: Path, target: str, *args: str) -> subprocess.CompletedProcess:
    """A run that pauses (ranks of --pause-ranks) until it is signalled; ``target``: ``launcher``, ``ranks``
    (every paused rank) or ``rank0``. Returns the finished run."""
    proc = subprocess.Popen(_command(out, *COMMON, *args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), start_new_session=True)
    paused = [out / f"paused_rank{rank}" for rank in ((0,) if target == "rank0" else (0, 1))]
    deadline = time.monotonic() + TIMEOUT
    while not all(path.is_file() and path.read_text() for path in paused):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out_, err = proc.communicate()
            raise AssertionError(f"the run never paused (exit {proc.returncode})\n{err[-4000:]}")
        time.sleep(0.01)  # polling interval of the watch, not a synchronisation delay
    pids = [proc.pid] if target == "launcher" else [int(path.read_text()) for path in paused]
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"SIGTERM to {target}: the run hung") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _losses(out: Path) -> list[str]:
    return [(out / f"losses_rank{rank}.txt").read_text() for rank in (0, 1)]


def _same_checkpoint(path: Path, reference: Path) -> None:
    """Everything a resume reads (model, optimizer, loops, every rank's loader and streams); not the
    callbacks' own bookkeeping (ModelCheckpoint's list of files)."""
    a, b = (torch.load(p, weights_only=False) for p in (path, reference))
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "torchtitan_rng_loader_by_rank",
                "global_step", "epoch"):
        assert_same_tensors(a[key], b[key], key)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every run of this file, side by side in two waves: (1) the uninterrupted run saving every step, the
    three signalled runs, two fit()s in one process, a refused loader, and the control's
    reference; (2) the resumes."""
    names = ("A", "launcher", "ranks", "rank0", "twice", "twice2", "refused", "nofork", "nofork_b",
             "A_resumed", "launcher_resumed")
    d = {name: tmp_path_factory.mktemp(name) for name in names}
    started = time.monotonic()
    wave1 = together(
        lambda: _ok(_run(d["A"], *COMMON, "--save-every", "1")),
        lambda: _signalled(d["launcher"], "launcher", "--pause-at", "2", "--pause-ranks", "0", "1"),
        # Every rank, after the first micro-batch of step 3.
        lambda: _signalled(d["ranks"], "ranks", "--pause-at", "2", "--pause-micro", "--pause-ranks", "0", "1"),
        # Rank 0 alone, with a user's stop callback and a plain DataLoader that the callback makes exact.
        lambda: _signalled(d["rank0"], "rank0", "--pause-at", "2", "--pause-ranks", "0", "--user-stop", "3",
                           "--loader", "plain"),
        # One process: a fit() stopped by its own SIGTERM (mid-accumulation: after the first micro-batch of step
        # 3), a second fit(), then a SIGTERM outside training.
        lambda: _run(d["twice"], *COMMON, "--signal-self-at", "2", "--again", str(d["twice2"]), "--sigterm-after",
                     nproc=1),
        lambda: _run(d["refused"], *COMMON, "--loader", "custom-sampler", nproc=1),
        # The control: validation without preserved streams, one process, saved at validation step 3.
        lambda: _ok(_run(d["nofork"], *COMMON, "--save-every", "3", "--no-val-fork", nproc=1)),
    )
    for name in ("A_resumed", "launcher_resumed"):
        (d[name] / "losses_rank0.txt").write_text("".join(_losses(d["A"])[0].splitlines(True)[:3]))
        (d[name] / "losses_rank1.txt").write_text("".join(_losses(d["A"])[1].splitlines(True)[:3]))
    (d["nofork_b"] / "losses_rank0.txt").write_text(
        "".join((d["nofork"] / "losses_rank0.txt").read_text().splitlines(True)[:3]))
    together(
        lambda: _ok(_run(d["A_resumed"], *COMMON, "--resume", str(d["A"] / "ckpt" / "step=3.ckpt"))),
        lambda: _ok(_run(d["launcher_resumed"], *COMMON, "--resume",
                         str(d["launcher"] / "ckpt" / "preempted-step=3.ckpt"))),
        lambda: _ok(_run(d["nofork_b"], *COMMON, "--no-val-fork", "--resume",
                         str(d["nofork"] / "ckpt" / "step=3.ckpt"), nproc=1)),
    )
    print(f"\nlightning stop runs: {time.monotonic() - started:.1f} s wall")
    return {"dirs": d, "procs": dict(zip(("A", "launcher", "ranks", "rank0", "twice", "refused", "nofork"),
                                           wave1))}


def test_a_validation_step_checkpoint_resumes_bitwise(runs: dict[str, Any]) -> None:
    # ModelCheckpoint(every_n_train_steps) at step 3, where validation (drawing from torch's stream) runs.
    d = runs["dirs"]
    a = _losses(d["A"])
    assert len(a[0].splitlines()) == STEPS and a[0] != a[1]
    assert _losses(d["A_resumed"]) == a


def test_control_validation_without_preserved_streams_differs(runs: dict[str, Any]) -> None:
    # The same stop and resume with validation moving the streams: the first resumed step differs.
    d = runs["dirs"]
    reference = (d["nofork"] / "losses_rank0.txt").read_text().splitlines()
    resumed = (d["nofork_b"] / "losses_rank0.txt").read_text().splitlines()
    assert len(resumed) == STEPS and resumed[:3] == reference[:3] and resumed[3] != reference[3]


def test_sigterm_to_the_launcher_saves_at_one_step_and_resumes_bitwise(runs: dict[str, Any]) -> None:
    d, proc = runs["dirs"], runs["procs"]["launcher"]
    # torchrun reports the signal it got (non-zero); its ranks saved at the agreed step first.
    assert proc.returncode != 0
    assert sorted(p.name for p in (d["launcher"] / "ckpt").iterdir()) == ["preempted-step=3.ckpt"]
    assert [len(text.splitlines()) for text in _losses(d["launcher"])] == [3, 3]
    assert _losses(d["launcher_resumed"]) == _losses(d["A"])


@pytest.mark.parametrize("case, step", [("ranks", 4), ("rank0", 3)])
def test_sigterm_to_ranks_saves_the_uninterrupted_runs_state(runs: dict[str, Any], case: str, step: int) -> None:
    # Every rank after the first micro-batch of step 3 (the vote cast at step 3's end is read at step 4's), or
    # rank 0 alone after step 2 (its train_dataloader() a plain DataLoader): the ranks exit 0 after saving, and
    # the checkpoint is the uninterrupted run's.
    d, proc = runs["dirs"], runs["procs"][case]
    assert proc.returncode == 0, proc.stderr[-4000:]
    _same_checkpoint(d[case] / "ckpt" / f"preempted-step={step}.ckpt", d["A"] / "ckpt" / f"step={step}.ckpt")
    assert _losses(d[case]) == ["".join(text.splitlines(True)[:step]) for text in _losses(d["A"])]


def test_a_users_stop_callback_at_a_validation_step_saves_the_uninterrupted_runs_state(runs: dict[str, Any]) -> None:
    d = runs["dirs"]
    _same_checkpoint(d["rank0"] / "ckpt" / "user-step=3.ckpt", d["A"] / "ckpt" / "step=3.ckpt")


def test_signal_handling_lasts_only_as_long_as_fit(runs: dict[str, Any]) -> None:
    # The first fit() stopped on its SIGTERM mid-accumulation (alone, no vote to wait for: saved at the end of
    # that step, 3); the second, in the same process, ran all its steps with the first's losses up to step 3;
    # then a SIGTERM outside fit() ended the process.
    d, proc = runs["dirs"], runs["procs"]["twice"]
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-4000:]
    assert not (d["twice"] / "survived_sigterm").exists()
    assert (d["twice"] / "ckpt" / "preempted-step=3.ckpt").is_file()
    assert not (d["twice2"] / "ckpt").exists()
    first = (d["twice"] / "losses_rank0.txt").read_text().splitlines()
    second = (d["twice2"] / "losses_rank0.txt").read_text().splitlines()
    assert len(first) == 3 and len(second) == STEPS and second[:3] == first


def test_a_loader_the_callback_cannot_make_exact_is_refused_before_the_first_step(runs: dict[str, Any]) -> None:
    # (A plain DataLoader with shuffle=True is made exact: the rank-0 case above trains from one.)
    d, proc = runs["dirs"], runs["procs"]["refused"]
    assert proc.returncode != 0
    assert "ExactResumeCallback trains from a DataLoader (not a subclass) over a map-style dataset" in proc.stderr
    assert not (d["refused"] / "losses_rank0.txt").exists()
