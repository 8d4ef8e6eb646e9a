"""World-size-invariant numerics (``parallelism.world_size_invariant``): the same bits at every process count that
divides the micro-batches per step, sharded by FSDP2, with or without pipeline stages.

``numerics.py`` is what a plan's layout asks (with any layout); ``setup.py`` checks that a run can be invariant
and sets it up; ``streams.py`` seeds the random streams per micro-batch and block; ``step.py`` deals a step's
micro-batches over the data shards and ends it; ``reduction.py`` sums them in slot order (and the grad norm in a
fixed order). The checkpoint's mode marker is ``parallel/mode.py``; the data side is ``data/global_sampler.py``.
"""
