"""World-size-invariant training (``parallelism.world_size_invariant``): the same bits at 1, 2, 4, 8... processes.

``plan.py`` is the mode's plan (what the trainer and the resume ask); ``setup.py`` checks that a run can be
invariant and sets it up; ``record.py`` marks its checkpoints; ``step.py`` runs a step's micro-batches with
per-micro-batch random streams; ``reduction.py`` sums them in one canonical tree. The data side is
``data/global_sampler.py``.
"""
