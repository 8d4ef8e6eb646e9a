"""How a step is split over processes: one plan per run (``plan.py``), composed from a layout (``layout.py``,
``pipeline.py``) and a numerics (``numerics.py``, ``invariant/``).

:func:`mode_of` is the one place that reads which mode a config asks for; everything else asks the plan.
"""

from __future__ import annotations

from torchtitan_rng.parallel.plan import Mode, ParallelPlan, mode_of

__all__ = ["Mode", "ParallelPlan", "mode_of"]
