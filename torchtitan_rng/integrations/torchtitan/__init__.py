"""Exact resume for torchtitan 0.3 (extra ``torchtitan``), as one override: no fork, no patch of torchtitan.

Turn it on with one flag on a stock launch command (docs/torchtitan.md)::

    --override.imports torchtitan_rng.integrations.torchtitan.exact_resume

torchtitan applies the override before it builds its components: the run's ``CheckpointManager`` becomes an
:class:`ExactResumeCheckpointManager` (``manager``), which is the stock manager plus

* every rank's global streams (Python, NumPy, torch CPU, its accelerator) in every checkpoint, captured at
  the step boundary where torchtitan saves, under a rank-unique key (``torchtitan_rng.rank_{r}``), each
  rank loading only its own (``TrainState``, as this project's trainer stores them);
* their restore at the step boundary *after* ``iter(dataloader)``: torchtitan's loader draws its
  ``_base_seed`` from the global CPU generator when the iterator is created, which ``train()`` does after
  loading the checkpoint. The manager hands the trainer's loader to the loop in a thin wrapper whose
  ``iter()`` creates the iterator, then restores the streams (``streams``);
* validation under preserved streams (the trainer's validator, wrapped the same way when it is enabled);
* a stop signal (SIGTERM, SIGUSR1): the ranks agree at a step boundary (one CPU all-reduce, read a step
  later), save a full checkpoint at that step, and the loop ends there: the run exits 0 (``stop``);
* a loss log (``loss_log.jsonl`` in ``dump_folder``, this project's format): every step torchtitan logs
  (``metrics.log_freq``), its float32 ``global_avg_loss`` written exactly, by the rank torchtitan reports
  metrics from (under pipeline parallelism, the last stage's), so ``python -m torchtitan_rng.compare_losses``
  reads torchtitan runs; written with or without ``--checkpoint.enable`` (``loss_log``);
* with the option ``tensor_fingerprint``, the tensor locator's fingerprints (``tensor_fingerprints/rank{R}.jsonl``
  in ``dump_folder``: each micro-batch, its loss, the gradients before clipping, the update, what a resume loaded,
  the optimizer state at saves (every step with ``fingerprint_optimizer_every_step``); the module calls at
  ``fingerprint_modules_at_step``), hashed on the device and read when torchtitan logs a step,
  so ``compare_losses`` names the first tensor two torchtitan runs differ in (``fingerprints``);
* the run record of this project (``run.json``: every resolved config key and the versions) in every
  checkpoint; a resume whose config differs in a key that can change the losses names each such key in a
  WARNING line (torchtitan's own workflows change keys on purpose, so nothing is refused) (``drift``);
* at each save, a check that the ranks of each group that must draw the same masks (tensor parallel, context
  parallel, HSDP's replicate dimension) hold the same mask streams (``mask_groups``), named in a WARNING line
  when they do not;
* another process count or layout at a resume: the checkpoint's run record holds the layout it was saved
  with (process count and parallel degrees); rank 0 names both in one WARNING line with the rule each rank's
  streams follow (``layout``): rank r restores the streams saved by rank r where the checkpoint has them, a
  rank the checkpoint lacks keeps the streams torchtitan seeded at start;
* a checkpoint without streams (saved by stock torchtitan), or a resume told not to load them
  (``--checkpoint.exclude_from_loading torchtitan_rng``), resumes with one WARNING line and fresh streams;
  a checkpoint of the plug-in resumes in stock torchtitan, which does not ask DCP for the extra key;
* with ``--dataloader.num_workers`` > 0, each loader worker's streams (Python, NumPy, torch CPU) in the
  loader's per-worker state (``workers``): a dataset that draws inside its workers (Flux's random crop and
  caption dropout, drawn in ``__iter__``) continues its streams at a resume instead of restarting them from
  the loader's seed; a loader whose workers' state cannot be carried is named.

Data randomness: the stock text loaders draw nothing at random; Flux's dataset draws, in the process that
iterates it (the trainer's, or a loader worker's).

Importing it also provides what torchtitan 0.3.0 calls and torch 2.13 (and older) lacks (``standins``):
``torch.distributed.set_timeout`` and the pipeline schedules' ``step`` with pre-split micro-batches.
"""

from __future__ import annotations

from typing import Any

from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.config.override import derive, override
from torchtitan.tools.logging import logger

from torchtitan_rng.distributed import barrier, rank_and_world_size
from torchtitan_rng.errors import EXIT_CODE, ConfigError
from torchtitan_rng.integrations import check_tested_version
from torchtitan_rng.integrations.torchtitan.drift import DEGREE_KEYS, QUIET_KEYS, config_drift, config_values
from torchtitan_rng.integrations.torchtitan.layout import (describe_layout, layout_change, layout_of,
                                                           saved_stream_ranks)
from torchtitan_rng.integrations.torchtitan.loss_log import attach_loss_log
from torchtitan_rng.integrations.torchtitan.manager import ExactResumeCheckpointManager
from torchtitan_rng.integrations.torchtitan.options import check_options
from torchtitan_rng.integrations.torchtitan.standins import provide_presplit_step, provide_set_timeout
from torchtitan_rng.integrations.torchtitan.streams import STREAMS_PART, _PreservedStreamsValidator
from torchtitan_rng.integrations.torchtitan.workers import carry_worker_streams
from torchtitan_rng.rng import MASK_STREAMS

__all__ = ["DEGREE_KEYS", "MASK_STREAMS", "QUIET_KEYS", "STREAMS_PART", "ExactResumeCheckpointManager",
           "_PreservedStreamsValidator", "attach_loss_log", "carry_worker_streams", "config_drift", "config_values",
           "describe_layout", "exact_resume", "layout_change", "layout_of", "provide_presplit_step",
           "provide_set_timeout", "saved_stream_ranks"]

check_tested_version("torchtitan")
provide_set_timeout()
provide_presplit_step()


# torchtitan registers an override under its factory's ``module.function``: this module's, the public target.
@override(target=CheckpointManager.Config, exact=True,
          description="torchtitan_rng: every rank's random streams in the checkpoint, restored after "
                      "iter(dataloader); validation under preserved streams; save-and-stop on signals")
def exact_resume(config: CheckpointManager.Config, **options: Any) -> ExactResumeCheckpointManager.Config:
    """The override: the run's checkpoint settings, on :class:`ExactResumeCheckpointManager`. ``options``
    (``signals``, ``restore_streams_at``, ``worker_streams``, ``tensor_fingerprint``,
    ``fingerprint_modules_at_step``, ``fingerprint_optimizer_every_step``) come from
    ``--override.imports 'TARGET={"signals": [...]}'``. A bad one: one line from rank 0, then exit 2 on every rank
    (torchtitan applies overrides on every rank, after starting the process group), no traceback."""
    try:
        check_options(options)
    except ConfigError as err:
        if rank_and_world_size()[0] == 0:
            logger.error(f"torchtitan_rng: {err}")
        barrier()  # torchrun ends every rank once one exits: none leaves before rank 0 has said why
        raise SystemExit(EXIT_CODE) from None
    return derive(config, ExactResumeCheckpointManager.Config, **options)
