"""World-size-invariant training (``parallelism.world_size_invariant``): the same bits at every process count that
divides the micro-batches per step, sharded by FSDP2.

``plan.py`` is the mode's plan (what the trainer and the resume ask), ``pipeline.py`` the same with pipeline
stages; ``setup.py`` checks that a run can be invariant and sets it up; ``record.py`` marks its checkpoints;
``streams.py`` seeds the random streams per micro-batch and block; ``step.py`` runs a step's micro-batches;
``reduction.py`` sums them in slot order (and the grad norm in a fixed order). The data side is
``data/global_sampler.py``.
"""
