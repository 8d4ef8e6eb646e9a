"""Runs that stop at a fault-injection point (``POINT:STEP:RANK:hold``) until the test has acted: the test
waits for the point's file, signals or kills whom it means to, then deletes the file to let the run go on.
Output goes to files, so that a process that dies leaves no pipe for its dataloader workers to hold open."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.launch import REPO, run_env
from torchtitan_rng.fault_injection import ENV_VAR as FAULT_ENV, HOLD_DIR_ENV


@dataclass
class Held:
    """A started process (its own session: ``pid`` is also its process group) and its output files."""

    proc: subprocess.Popen
    holds: Path
    out: Path

    def wait_held(self, pattern: str, timeout: float = 300) -> Path:
        """Block until the run holds at a point matching ``pattern`` (``POINT-STEP-rankR``, a glob); its file
        is returned."""
        return self.wait_all_held(pattern, 1, timeout)[0]

    def wait_all_held(self, pattern: str, count: int, timeout: float = 300) -> list[Path]:
        """Block until ``count`` processes hold at points matching ``pattern`` (e.g. every dataloader worker of
        a rank: ``data_loading-0-rank0-worker*``); their files are returned."""
        deadline = time.monotonic() + timeout
        while len(held := sorted(self.holds.glob(pattern))) < count:
            if self.proc.poll() is not None:
                raise AssertionError(f"the run ended (exit {self.proc.returncode}) before holding at {pattern}\n"
                                     f"{self.stdout()[-3000:]}\n{self.stderr()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the run did not hold at {pattern} within {timeout} s")
            time.sleep(0.01)  # polling interval of the watch, not a synchronisation delay
        return held

    def finish(self, timeout: float = 300) -> subprocess.CompletedProcess:
        self.proc.wait(timeout=timeout)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, self.stdout(), self.stderr())

    def stdout(self) -> str:
        return (self.out / "stdout").read_text()

    def stderr(self) -> str:
        return (self.out / "stderr").read_text()


def start_held(command: list[str], out: Path, faults: str, env: dict[str, str] | None = None,
               cwd: Path = REPO) -> Held:
    """Start ``command`` with ``faults`` armed (``TORCHTITAN_RNG_FAULT``); its files go in ``out``."""
    holds = out / "holds"
    holds.mkdir(parents=True)
    with (out / "stdout").open("w") as stdout, (out / "stderr").open("w") as stderr:
        proc = subprocess.Popen(command, cwd=cwd, stdout=stdout, stderr=stderr, start_new_session=True,
                                env=run_env({FAULT_ENV: faults, HOLD_DIR_ENV: str(holds), **(env or {})}))
    return Held(proc, holds, out)
