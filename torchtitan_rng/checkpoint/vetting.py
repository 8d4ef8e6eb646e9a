"""May this checkpoint be resumed? The one answer, given before anything is loaded.

The launcher's preflight (before any process starts), the trainer and ``ExactResume.load`` all call
:func:`vet`, which refuses in this order, each refusal one line (:class:`CheckpointError`, or
:class:`ConfigDriftError` for a changed config):

0. with a signing key: ``checksums.json`` signed with it (integrity.py), before anything else is read;
1. whole and readable: DCP's ``.metadata`` through the safe reader, every shard file there at its size;
2. its layout: the parallel mode that saved it and its process count, by the rule of the run's plan
   (``layout``: refuses, or says the run goes on inexactly with reseeded streams);
3. its files as written: ``checksums.json`` (read once: on rank 0, or by the launcher, which tells the
   ranks through ``integrity.VERIFIED_ENV``);
4. its run record against this run's (``run.json``): each changed trajectory key refused, or a WARNING
   where the caller allows it.

What may go on but should be said (no checksums, no record, allowed changes, other versions) comes back as
lines for rank 0 to print. Every rank decides alike from the same files, so all ranks refuse together.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from torchtitan_rng.checkpoint import integrity, run_record
from torchtitan_rng.checkpoint.dcp_io import inspect_checkpoint
from torchtitan_rng.checkpoint.layout import CheckpointInfo, completion
from torchtitan_rng.checkpoint.storage import Where, locate
from torchtitan_rng.distributed import on_rank_zero
from torchtitan_rng.errors import CheckpointError

# A mode's rule for a checkpoint's layout: raises when it cannot continue it; True: inexactly, reseeded.
LayoutRule = Callable[[CheckpointInfo], bool]


@dataclass(frozen=True)
class Vetted:
    """A checkpoint that may be loaded: what it holds, whether the run goes on reseeded, and what to say."""

    info: CheckpointInfo
    reseed: bool
    warnings: list[str] = field(default_factory=list)


def vet(path: Where, *, layout: LayoutRule, record: dict[str, Any] | None, allowed: Sequence[str] = (),
        opt_in: run_record.OptIn = run_record.OptIn(), device: torch.device = torch.device("cpu"),
        signing: integrity.SigningKey | None = None, compared: run_record.Compared | None = None) -> Vetted:
    """Vet ``path`` in the order above. ``record``: this run's run record (None: not compared);
    ``allowed``/``opt_in``: which changed keys become WARNINGs and how a refusal says to allow them;
    ``device``: where the ranks agree on rank 0's reading of the files; ``signing``: the key checkpoints
    are signed with (None: not checked); ``compared``: the run's parallel mode's view of a config, as it compares
    them (the keys it gives the same bits under left out, its layout as it runs)."""
    path = locate(path)
    warnings = integrity.verify_signature(path, signing)
    info = inspect_checkpoint(path)
    reseed = layout(info)
    verified = os.environ.get(integrity.VERIFIED_ENV) == str(path)
    if not (verified and (path / integrity.CHECKSUMS_NAME).is_file()):
        def verify() -> None:
            if integrity.verify_integrity(path):
                return
            why = completion(path).without_checksums
            warnings.append(f"WARNING: checkpoint {path} is unsigned and unchecked: it has no "
                            f"{integrity.CHECKSUMS_NAME} ({why}), so damage to its files cannot be detected")
        on_rank_zero(verify, CheckpointError(f"checkpoint {path} is damaged (rank 0 names the file)"), device,
                     (CheckpointError,))
    if record is not None:
        warnings += run_record.check_resume(path, run_record.read_record(path), record, allowed, opt_in,
                                             compared)
    return Vetted(info, reseed, warnings)
