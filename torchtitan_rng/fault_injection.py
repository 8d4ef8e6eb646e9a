"""Fault-injection points for tests: a rank kills (or signals) itself at a named moment of a run.

Tests need "SIGKILL exactly while step-10 is being written", not "SIGKILL after about two seconds". The
environment variable ``TORCHTITAN_RNG_FAULT`` arms one or more points, separated by ``;``:

    POINT:STEP[:RANK[:SIGNAL]]      RANK: a rank or ``*`` (default: every rank); SIGNAL default SIGKILL

Points, in the order a step meets them:

* ``before_step``   right before step STEP starts (the previous step is complete and logged)
* ``save_writing``  while DCP writes the checkpoint of STEP: half of this rank's items are handed to the
  writer, the file is open (the folder is ``step-STEP.partial``)
* ``save_written``  DCP has written everything of STEP, ``.metadata`` included, but the folder is still
  ``step-STEP.partial``
* ``save_renamed``  ``step-STEP`` is in place; older checkpoints are not pruned yet
* ``prune``         pruning after the save of STEP: the first old checkpoint is moved aside, not deleted

and one that fires no signal: ``loss_spike`` multiplies every micro-batch loss of STEP on RANK by
``LOSS_SPIKE_FACTOR`` (its gradients too), as a batch of broken samples would: a spike for the spike guard
(``training.spike_guard``) to find. It changes nothing else of the step (data, random draws), and holds on
every run the variable is set in, a resumed one included.

Each armed entry fires once. Unset (the normal case), the trainer builds no injector and hands none to
the checkpoint manager: the production save path does not know this module.
"""

from __future__ import annotations

import io
import os
import signal
from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

ENV_VAR = "TORCHTITAN_RNG_FAULT"
POINTS = ("before_step", "save_writing", "save_written", "save_renamed", "prune", "loss_spike")
LOSS_SPIKE_FACTOR = 1000.0


@dataclass(frozen=True)
class _Fault:
    point: str
    step: int
    rank: int | None
    signum: int


def _parse(spec: str) -> dict[tuple[str, int], list[_Fault]]:
    faults: dict[tuple[str, int], list[_Fault]] = {}
    for entry in filter(None, (part.strip() for part in spec.split(";"))):
        fields = entry.split(":")
        if len(fields) < 2 or fields[0] not in POINTS:
            raise ValueError(f"{ENV_VAR}: bad entry {entry!r}; expected POINT:STEP[:RANK[:SIGNAL]], POINT in {POINTS}")
        rank = None if len(fields) < 3 or fields[2] == "*" else int(fields[2])
        signum = int(getattr(signal, fields[3])) if len(fields) > 3 else int(signal.SIGKILL)
        fault = _Fault(fields[0], int(fields[1]), rank, signum)
        faults.setdefault((fault.point, fault.step), []).append(fault)
    return faults


class FaultInjector:
    """The hooks a CheckpointManager (and the trainer, at ``before_step``) calls; built by the trainer only
    when the environment variable arms a point, so a normal run has none."""

    def __init__(self, spec: str, rank: int) -> None:
        self.rank = rank
        self._armed = {key: [f for f in faults if f.rank is None or f.rank == rank]
                       for key, faults in _parse(spec).items()}

    @classmethod
    def from_env(cls, rank: int) -> FaultInjector | None:
        spec = os.environ.get(ENV_VAR, "")
        return cls(spec, rank) if spec else None

    def at(self, point: str, step: int) -> None:
        """Fire the faults armed for ``point`` at ``step`` on this rank (each once)."""
        faults = self._armed.get((point, step), [])
        while faults:
            os.kill(os.getpid(), faults.pop(0).signum)

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
