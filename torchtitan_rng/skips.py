"""Skipped steps (``training.skip_steps``): which steps apply no update, and what a resume may add.

A skipped step runs exactly as a trained one up to the update: it takes its micro-batches from the loader and
its forward and backward draw the random streams they always draw, so every later step sees the samples and
streams it would have seen; then the optimizer does not step. The learning-rate schedule and the step counter
advance (later steps stay on the curve of the run without skips, and step numbers keep naming the same data).
Its loss-log line holds the loss and gradient norm it computed, with ``"skipped": true``.

The mode a run trains in plays no part: both plans consume and draw inside ``forward_backward``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchtitan_rng.config import JobConfig, format_skip_steps, parse_skip_steps
from torchtitan_rng.errors import ConfigError

KEY = "training.skip_steps"


def skipped_steps(config: JobConfig) -> frozenset[int]:
    return parse_skip_steps(config.training.skip_steps)


def canonical(value: str) -> str:
    """The spelling a run record compares ("6, 7,9" and "6-7,9" are the same steps)."""
    return format_skip_steps(parse_skip_steps(value))


def refuse_past_steps(config: JobConfig, saved_record: dict[str, Any] | None, checkpoint: Path, step: int) -> None:
    """A skip added at a resume for a step the checkpoint has already trained cannot be applied: refused, with
    the way to apply it (an earlier checkpoint)."""
    saved = parse_skip_steps(str(((saved_record or {}).get("config") or {}).get(KEY, "")))
    past = sorted(s for s in skipped_steps(config) - saved if s <= step)
    if past:
        raise ConfigError(f"{KEY} adds step(s) {format_skip_steps(set(past))}, which checkpoint {checkpoint} (step "
                          f"{step}) has already trained; leave them out, or start a new dump folder from a checkpoint "
                          "before them (--checkpoint.initial_load_path .../step-N)")
