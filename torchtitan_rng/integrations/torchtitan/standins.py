"""What torchtitan 0.3.0 calls and torch 2.13 (and older) lacks, provided where it is missing: a torch that has
them keeps its own. torchtitan 0.3.0 is written against torch 2.14."""

from __future__ import annotations

import functools
import inspect
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def provide_set_timeout() -> None:
    """torchtitan 0.3.0 calls ``torch.distributed.set_timeout(timeout, group)`` after each process's first
    step; torch releases up to 2.13 do not have it (only ``ProcessGroup.set_timeout``), so every run would
    crash there. Provide it where it is missing, with the same meaning; a torch that has it keeps its own."""
    if hasattr(dist, "set_timeout"):
        return

    def set_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
        (group if group is not None else dist.distributed_c10d._get_default_group()).set_timeout(timeout)

    dist.set_timeout = set_timeout  # type: ignore[attr-defined]


def provide_presplit_step() -> None:
    """torchtitan 0.3.0 runs pipeline parallelism with micro-batches it has split itself:
    ``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)`` (and ``eval`` the same way). torch releases up
    to 2.13 take only whole-batch inputs there, and read those keywords as model inputs (``ValueError: Expecting
    2 arg_mbs but got 1`` at step 1). Where the schedules lack them, ``step`` takes them as torch 2.14 does: the
    schedule runs the given micro-batches, unsplit; a call without them is torch's own. A torch that has
    them keeps its own."""
    from torch.distributed.pipelining import schedules

    for schedule in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        if "arg_mbs" in inspect.signature(schedule.step).parameters:
            continue
        schedule.step = _presplit_step(schedule.step)  # type: ignore[method-assign]


def _presplit_step(whole_batch: Any) -> Any:
    @functools.wraps(whole_batch)  # its signature and docs; ``__wrapped__`` is torch's own
    def step(self: Any, *args: Any, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
             target_mbs: list | None = None, **kwargs: Any) -> Any:
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return whole_batch(self, *args, **kwargs)
        if args or kwargs.get("target") is not None:
            raise TypeError("schedule.step takes whole-batch inputs or micro-batches (arg_mbs, kwarg_mbs, "
                            "target_mbs), not both")
        run = self._step_microbatches

        def given_microbatches(_args: list, _kwargs: list, _targets: list | None, *rest: Any,
                               **options: Any) -> Any:
            return run(arg_mbs, kwarg_mbs, target_mbs, *rest, **options)

        # torch's step does everything around the micro-batches (stage flags, cleared state, merged outputs);
        # with no whole-batch input its split yields empty micro-batches, replaced here by the given ones.
        self._step_microbatches = given_microbatches
        try:
            return whole_batch(self, **kwargs)
        finally:
            del self._step_microbatches

    return step
