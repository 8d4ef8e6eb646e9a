"""Stop signals without a training run: dataloader workers ignore every signal their rank stops on (Ctrl-C
included); the first SIGINT only records a stop, and a second one ends the process (taken off the list, it
raises KeyboardInterrupt again); the launcher's exit code is 2 whichever rank failed first; a fault armed for
a run fires in its first attempt only."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from tests.support.launch import REPO, run_env
from torchtitan_rng.fault_injection import FaultInjector
from torchtitan_rng.launch.launcher import _failed

WORKER_DISPOSITIONS = """
import signal, torch
import torchtitan_rng
from torchtitan_rng import signals
from torchtitan_rng.data.dataloader import shutdown_workers

signals.install(("SIGTERM", "SIGUSR1", "SIGINT"))
class Dispositions(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, index):
        return torch.tensor([int(signal.getsignal(s) == signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)])
loader = torchtitan_rng.build_dataloader(Dispositions(), batch_size=1, seed=0, num_workers=1)
print(next(iter(loader)).tolist(), flush=True)
shutdown_workers(loader)
"""

TWO_CTRL_C = """
import os, signal
from torchtitan_rng import signals

signals.install(("SIGTERM", "SIGINT"))
os.kill(os.getpid(), signal.SIGINT)
print("first:", signals.received(), flush=True)
os.kill(os.getpid(), signal.SIGINT)
print("still alive after the second")
"""

CTRL_C_NOT_LISTED = """
import signal
from torchtitan_rng import signals

# Python's own Ctrl-C handler, as in a process started from a terminal (a suite started in the background
# inherits SIGINT ignored, and giving back "ignored" would be right there too).
signal.signal(signal.SIGINT, signal.default_int_handler)
signals.install(("SIGTERM", "SIGINT"))  # the defaults, before the config is read
signals.install(("SIGTERM",))           # a config without SIGINT
try:
    signal.raise_signal(signal.SIGINT)
except KeyboardInterrupt:
    print("KeyboardInterrupt")
"""


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=run_env())


def test_dataloader_workers_ignore_the_stop_signals() -> None:
    proc = _python(WORKER_DISPOSITIONS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[[1, 1, 1]]"  # SIGTERM, SIGUSR1, SIGINT: ignored in the worker


def test_first_ctrl_c_records_a_stop_and_the_second_ends_the_process() -> None:
    proc = _python(TWO_CTRL_C)
    assert proc.stdout == "first: SIGINT\n"
    assert proc.returncode == -signal.SIGINT
    assert proc.stderr.startswith("SIGINT: saving a checkpoint at the next step boundary") and proc.stderr.count("\n") == 1


def test_ctrl_c_taken_off_the_stop_signals_raises_keyboard_interrupt_again() -> None:
    """A config without SIGINT gives Ctrl-C back its Python meaning (an error the run reports, its queued loss
    lines written), not the default action, which ends the process where it stands."""
    proc = _python(CTRL_C_NOT_LISTED)
    assert (proc.returncode, proc.stdout) == (0, "KeyboardInterrupt\n"), proc.stderr[-3000:]


def _failure(rank: int, exitcode: int) -> ProcessFailure:
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="")


@pytest.mark.parametrize("rank0, rank1", [(2, 2), (2, -signal.SIGTERM), (-signal.SIGTERM, 2), (-signal.SIGKILL, 2)])
def test_launcher_exit_code_is_2_whichever_rank_failed_first(rank0: int, rank1: int,
                                                             capsys: pytest.CaptureFixture) -> None:
    assert _failed({0: _failure(0, rank0), 1: _failure(1, rank1)}) == 2
    assert capsys.readouterr().err == ""  # rank 0's own line is the one line


def test_launcher_names_a_reporting_rank_whose_output_is_not_shown(capsys: pytest.CaptureFixture) -> None:
    assert _failed({1: _failure(1, 2)}) == 2
    assert capsys.readouterr().err == "error: rank 1 failed; its one-line message is in its own output\n"


def test_faults_fire_in_the_first_attempt_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHTITAN_RNG_FAULT", "before_step:3:1:SIGKILL")
    assert FaultInjector.from_env(1) is not None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert FaultInjector.from_env(1) is None


def test_held_samples_wrap_only_where_armed_and_change_nothing_of_the_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """The data_loading point's wrapper: absent from a normal run; armed, the same samples, the same form of
    randomness (a per-sample dataset stays one), and a Stateful dataset's state still reachable."""
    from torchtitan_rng.data.sample_rng import SampleRandomDataset
    from torchtitan_rng.data.worker_rng import uses_global_rng
    from torchtitan_rng.fault_injection import held_samples

    class Keyed(SampleRandomDataset):
        def __len__(self) -> int:
            return 3

        def __getitem__(self, key: int) -> int:
            return key * 10

        def state_dict(self) -> dict:
            return {"at": 1}

        def load_state_dict(self, state: dict) -> None:
            self.loaded = state

    dataset = Keyed(0, "test")
    monkeypatch.delenv("TORCHTITAN_RNG_FAULT", raising=False)
    assert held_samples(dataset, 0) is dataset
    monkeypatch.setenv("TORCHTITAN_RNG_FAULT", "data_loading:0:0:hold")
    assert held_samples(dataset, 1) is dataset  # armed for rank 0 only
    held = held_samples(dataset, 0)
    assert held is not dataset and [held[k] for k in range(3)] == [0, 10, 20]  # no worker here: no hold
    assert not uses_global_rng(held) and uses_global_rng(held_samples(torch.utils.data.TensorDataset(torch.ones(2)), 0))
    held.load_state_dict({"at": 2})
    assert held.state_dict() == {"at": 1} and dataset.loaded == {"at": 2}
