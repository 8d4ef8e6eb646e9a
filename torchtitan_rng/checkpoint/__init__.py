"""Checkpoints: what a run saves, where, how it is loaded safely, and how a run resumes from one.

What a checkpoint holds (the whole format, with examples: docs/checkpoint_format.md):

``{folder}/step-N/`` — written as ``step-N.partial`` and renamed once every rank has finished (layout.py), so
a ``step-N`` with DCP's ``.metadata`` is complete; ``step-N.deleting`` is a pruned one being removed. The
folder may be a URL (storage.py: a local folder or an fsspec store behind one interface; dcp_io.py: DCP's
reader and writer for each); a store cannot rename, so there a ``step-N/`` counts once ``complete.json``,
written last, is in it (layout.completion: the one rule of each storage).

* ``.metadata`` and ``__{rank}_{i}.distcp``: one torch.distributed.checkpoint state dict whose top-level keys
  are the parts (layout.PARTS, assembled by states.checkpoint_parts):

  - ``model.<param>``, ``optimizer.state.<param>.*``, ``optimizer.param_groups.<param>.*`` — weights and
    optimizer state keyed by parameter names, reshardable by DCP;
  - ``lr_scheduler.last_epoch`` — how far the schedule has gone (its shape is the config's);
  - ``dataloader.dp_rank_{r}`` — data-parallel rank r's loader position (sampler, worker snapshot, per-worker
    state; a streaming source's file position and shuffle buffers);
  - ``train_state.step`` and ``train_state.rank_{r}`` — the step, and rank r's global random streams
    (Python, NumPy, torch CPU, device, registered generators) with its world size and device type;
  - ``world_size_invariant.{global,local}_batch_size`` — only in a world-size-invariant run; marks the mode;
  - an own loop's ``extra`` parts under their names.

  Per-rank values live under rank-unique keys (DCP keeps one copy of a same-key value saved from every
  rank) and are one ``bytes`` item each, encoded without pickle (codec.py). The number of
  ``train_state.rank_{r}`` keys is the process count that saved the checkpoint.
* ``run.json`` — the resolved config, a fingerprint of the data and the versions (run_record.py).
* ``checksums.json`` — size and a 128-bit sum of every other file (integrity.py); with a signing key,
  ``signature.json`` — its HMAC-SHA256.
* ``complete.json`` — the completion marker, ``{"step": N}``, written last (layout.py).

Before a load, vetting.py decides whether the checkpoint may be resumed (signature, whole, layout, checksums,
run record, in that order); loading reads ``.metadata`` with an unpickler that knows only DCP's classes and every
other non-tensor item with ``weights_only=True`` (safe_load.py).
"""
