"""``loss_spike`` for pipeline stages, loaded with ``--job.custom_module tests.support.pipeline_loss_spike``.

The pipeline plan computes each micro-batch's loss with its train spec's pipeline split inside the schedule, not
with the whole-model loss function that ``fault_injection.loss_spike`` multiplies: without this module the spike
never reaches a pipelined step. Here the split's loss is multiplied instead, by the same injector, for the steps
``TORCHTITAN_RNG_FAULT`` arms; nothing else of the step changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan_rng.fault_injection import FaultInjector
from torchtitan_rng.parallel.pipeline import PipelinePlan

_forward_backward = PipelinePlan.forward_backward


def _spiked_forward_backward(self: PipelinePlan, *args: Any) -> Any:
    step = args[-1]
    faults = FaultInjector.from_env(self.world.rank)
    split = self.split
    if faults is None or split is None:
        return _forward_backward(self, *args)
    self.split = dataclasses.replace(split, loss=faults.loss_fn(split.loss, step))
    try:
        return _forward_backward(self, *args)
    finally:
        self.split = split


PipelinePlan.forward_backward = _spiked_forward_backward  # type: ignore[method-assign]
