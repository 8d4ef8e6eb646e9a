"""How a step is split over processes: one plan per parallel mode (``plan.py`` is the interface).

:func:`plan_class` is the one place that reads which mode a config asks for; everything else asks the plan.
"""

from __future__ import annotations

from torchtitan_rng.config import Parallelism
from torchtitan_rng.parallel.data_parallel import DataParallelPlan
from torchtitan_rng.parallel.invariant.plan import InvariantPlan
from torchtitan_rng.parallel.plan import ParallelPlan


def plan_class(parallelism: Parallelism) -> type[ParallelPlan]:
    """The plan of the mode ``parallelism`` asks for."""
    pipelined, invariant = parallelism.pipeline_parallel_degree > 1, parallelism.world_size_invariant
    if pipelined:
        # Imported only here: torch.distributed.pipelining pulls in torch._dynamo, ~0.6 s of CPU that the
        # launcher of a run that does not pipeline need not spend.
        from torchtitan_rng.parallel.invariant.pipeline import InvariantPipelinePlan
        from torchtitan_rng.parallel.pipeline import PipelinePlan

        return InvariantPipelinePlan if invariant else PipelinePlan
    return InvariantPlan if invariant else DataParallelPlan
