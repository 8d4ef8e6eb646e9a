"""How a step is split over processes: one plan per parallel mode (``plan.py`` is the interface).

:func:`plan_class` is the one place that reads which mode a config asks for; everything else asks the plan.
"""

from __future__ import annotations

from torchtitan_rng.config import JobConfig
from torchtitan_rng.parallel.data_parallel import DataParallelPlan
from torchtitan_rng.parallel.invariant.plan import InvariantPlan
from torchtitan_rng.parallel.plan import ParallelPlan


def plan_class(config: JobConfig) -> type[ParallelPlan]:
    """The plan of the mode ``config`` asks for."""
    if config.parallelism.pipeline_parallel_degree > 1:  # it refuses the invariant mode (not yet built)
        # Imported only here: torch.distributed.pipelining pulls in torch._dynamo, ~0.6 s of CPU in every
        # process (each rank and the launcher) of a run that does not pipeline.
        from torchtitan_rng.parallel.pipeline import PipelinePlan

        return PipelinePlan
    return InvariantPlan if config.parallelism.world_size_invariant else DataParallelPlan
