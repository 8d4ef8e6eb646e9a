"""Fault-injection points for tests: a rank kills (or signals) itself, or holds, at a named moment of a run.

Tests need "SIGKILL exactly while step-10 is being written", not "SIGKILL after about two seconds". The
environment variable ``TORCHTITAN_RNG_FAULT`` arms one or more points, separated by ``;``:

    POINT:STEP[:RANK[:ACTION]]      RANK: a rank or ``*`` (default: every rank)

ACTION is a signal name (default SIGKILL), sent by the rank to itself, or ``hold``: the rank creates the file
``POINT-STEP-rankRANK`` in the folder ``TORCHTITAN_RNG_FAULT_DIR`` names and waits there until that file is
deleted, so that a test can act (signal the launcher, kill the job) while the run is exactly at that point.

Points, in the order a run meets them (the start-up ones, STEP 0, live in the light fault_points.py; the
launcher's hold in the launcher, file ``POINT-0-launcher``):

* ``launcher_start``, ``launcher_preflight``, ``launcher_checked``, ``launcher_locked``: the launcher's first
  statement (before torch is imported), before the preflight, after it, after it took the dump folder's lock
* ``launcher_ranks_started``  torchrun has started the ranks (their interpreters are starting)
* ``rank_start``    a rank's first statement, before its signal handlers are installed
* ``before_process_group``  the rank's handlers are in place, the process group not yet up
* ``startup``       start-up (STEP: 0): the process group is up; model, data and resume are still to come
* ``startup_done``  built, resumed, the loader's iterator made: the last moment before the first step
* ``data_loading``  a dataloader worker is in ``__getitem__`` (STEP: 0): every worker of the rank holds at its
  first sample, each with its own file ``data_loading-0-rankR-workerW``, so no batch is ready until the test
  lets them go (a map-style dataset is wrapped by :func:`held_samples`; with no workers, nothing holds)
* ``compile``       torch.compile starts compiling a graph during step STEP (the first compile of a run is in
  its first step: the compiled code is built lazily, at the first call)
* ``before_step``   right before step STEP starts (the previous step is complete and logged)
* ``validation``    step STEP has trained and is about to validate (``validation.enable``)
* ``save_writing``  while DCP writes the checkpoint of STEP: half of this rank's items are handed to the
  writer, the file is open (the folder is ``step-STEP.partial``; on an object store, the upload of
  ``step-STEP`` is under way)
* ``save_written``  DCP has written everything of STEP, ``.metadata`` included, but the folder is still
  ``step-STEP.partial``
* ``save_marking``  ``run.json`` and ``checksums.json`` are written, the completion marker not yet (the
  last moment before the checkpoint counts)
* ``save_renamed``  ``step-STEP`` is in place (on an object store: marked complete); older checkpoints are
  not pruned yet
* ``prune``         pruning after the save of STEP: the first old checkpoint is moved aside, not deleted

and one that fires no signal: ``loss_spike`` multiplies every micro-batch loss of STEP on RANK by
``LOSS_SPIKE_FACTOR`` (its gradients too), as a batch of broken samples would: a spike for the spike guard
(``training.spike_guard``) to find. It changes nothing else of the step (data, random draws), and holds on
every run the variable is set in, a resumed one included.

Each armed entry fires once, and only in a run's first attempt: ranks that torchrun restarted
(``--max-restarts``) arm nothing, as a crash injected once does not come back. Unset (the normal case), the
trainer builds no injector and hands none to
the checkpoint manager: the production save path does not know this module.
"""

from __future__ import annotations

import io
import os
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem
from torch.utils.data import Dataset, get_worker_info

from torchtitan_rng.fault_points import ENV_VAR, HOLD, HOLD_DIR_ENV, POINTS, hold, parse  # noqa: F401 (re-exported)

LOSS_SPIKE_FACTOR = 1000.0


class FaultInjector:
    """The hooks a CheckpointManager (and the trainer, at ``before_step``) calls; built by the trainer only
    when the environment variable arms a point, so a normal run has none."""

    def __init__(self, spec: str, rank: int) -> None:
        self.rank = rank
        self._armed = {key: [f for f in faults if f.rank is None or f.rank == rank]
                       for key, faults in parse(spec).items()}

    @classmethod
    def from_env(cls, rank: int) -> FaultInjector | None:
        spec = os.environ.get(ENV_VAR, "")
        restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
        return cls(spec, rank) if spec and not restarted else None

    def armed(self, point: str) -> bool:
        """Whether any fault is armed for ``point`` on this rank, at any step."""
        return any(faults for (armed, _), faults in self._armed.items() if armed == point)

    def at(self, point: str, step: int, who: str = "") -> None:
        """Fire the faults armed for ``point`` at ``step`` on this rank (each once); ``who`` ends the hold
        file's name where several processes of one rank hold at the same point (its loader's workers)."""
        faults = self._armed.get((point, step), [])
        while faults:
            fault = faults.pop(0)
            if fault.signum == HOLD:
                self._hold(f"{point}-{step}-rank{self.rank}{who}")
            else:
                os.kill(os.getpid(), fault.signum)

    def watch_compiles(self, step: Callable[[], int]) -> None:
        """Fire ``compile`` when torch.compile starts compiling, at the step ``step()`` says is running."""
        if self.armed("compile"):
            from torch._dynamo.callback import on_compile_start  # only where a test arms the point

            on_compile_start(lambda _: self.at("compile", step()))

    def _hold(self, name: str) -> None:
        hold(name)

    def loss_fn(self, loss_fn: Callable[..., torch.Tensor], step: int) -> Callable[..., torch.Tensor]:
        """``loss_fn`` for ``step`` on this rank: scaled by LOSS_SPIKE_FACTOR where ``loss_spike`` is armed."""
        if not self._armed.get(("loss_spike", step)):
            return loss_fn
        return lambda *args: loss_fn(*args) * LOSS_SPIKE_FACTOR

    def save_planner(self, step: int) -> DefaultSavePlanner | None:
        """The planner for ``dcp.save`` when ``save_writing`` is armed for this step, else None (DCP's own)."""
        return _FaultySavePlanner(self, step) if self._armed.get(("save_writing", step)) else None


class _FaultySavePlanner(DefaultSavePlanner):
    """DCP's planner, firing ``save_writing`` when half of this rank's items went to the open file."""

    def __init__(self, faults: FaultInjector, step: int) -> None:
        super().__init__()
        self.faults, self.step, self.resolved = faults, step, 0

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        self.resolved += 1  # DCP's writer calls this item by item, with the shard file open
        if 2 * self.resolved >= len(self.plan.items):
            self.faults.at("save_writing", self.step)
        return super().resolve_data(write_item)


class _HeldSamples(Dataset):
    """``dataset``, whose first ``__getitem__`` in each dataloader worker fires ``data_loading`` (each worker
    process has its own copy of this object, so each fires once). Adds no randomness: the data is the same."""

    adds_no_randomness = True

    def __init__(self, dataset: Dataset, rank: int) -> None:
        self.dataset = dataset
        self.rank = rank
        self.fired = False

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: int) -> Any:
        worker = get_worker_info()
        if worker is not None and not self.fired:
            self.fired = True
            faults = FaultInjector.from_env(self.rank)
            if faults is not None:
                faults.at("data_loading", 0, who=f"-worker{worker.id}")
        return self.dataset[key]


class _HeldStatefulSamples(_HeldSamples):
    """The same around a Stateful dataset, whose state the loader saves per worker: it stays reachable."""

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)  # type: ignore[attr-defined]


def held_samples(dataset: Dataset, rank: int) -> Dataset:
    """``dataset`` wrapped to fire ``data_loading`` in its workers when the environment arms that point on
    ``rank``; else ``dataset`` itself (a normal run's data path has no wrapper)."""
    faults = FaultInjector.from_env(rank)
    if faults is None or not faults.armed("data_loading"):
        return dataset
    stateful = callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))
    return (_HeldStatefulSamples if stateful else _HeldSamples)(dataset, rank)
