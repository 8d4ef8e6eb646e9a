"""The run record's comparison at a resume: which changed config keys can change the losses."""

from __future__ import annotations

import json
import re
from typing import Any

# Config keys (``section.key`` or whole sections, ``section.*``) that cannot change the losses a resume trains:
# where and how often to save or log, timeouts, what runs inside preserved streams, how the config was given.
QUIET_KEYS = ("checkpoint.*", "metrics.*", "profiler.*", "comm.*", "validator.*", "override.*", "dump_folder",
              "debug.print_config", "debug.save_config_file", "training.steps")
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # reprs of functions in the config differ between processes

# The parallel degrees as configured; where the checkpoint records its resolved layout, the layout's own line
# names a change of them (layout.layout_change), once.
DEGREE_KEYS = tuple(f"parallelism.{name}_degree" for name in (
    "data_parallel_replicate", "data_parallel_shard", "context_parallel", "tensor_parallel", "pipeline_parallel",
    "expert_parallel"))


def config_values(config: Any) -> dict[str, Any]:
    """Every key of a torchtitan config as ``section.key`` (nested: ``a.b.c``), as JSON values."""
    values: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}.")
            else:
                values[prefix + key] = value

    walk(json.loads(_ADDRESS.sub("", json.dumps(config.to_dict(), default=repr))), "")
    return values


def horizon_matters(values: dict[str, Any]) -> bool:
    """Whether the learning-rate schedule depends on ``training.steps`` (a decay spread over the run)."""
    return values.get("lr_scheduler.decay_ratio") != 0


def is_quiet(key: str) -> bool:
    """Whether ``key`` is one of ``QUIET_KEYS`` (itself or its section)."""
    return key in QUIET_KEYS or f"{key.split('.')[0]}.*" in QUIET_KEYS


def config_drift(saved: dict[str, Any], current: dict[str, Any], layout_recorded: bool = False) -> list[str]:
    """One line per key that differs and can change the losses (``QUIET_KEYS`` and keys one side lacks
    are not compared; ``training.steps`` only where the schedule's decay depends on it; the parallel degrees
    only where the checkpoint has no recorded layout)."""
    def quiet(key: str) -> bool:
        return is_quiet(key) or (layout_recorded and key in DEGREE_KEYS)

    lines = [f"{key} = {current[key]!r} but the checkpoint was trained with {saved[key]!r}"
             for key in sorted(set(saved) & set(current)) if not quiet(key) and saved[key] != current[key]]
    steps = "training.steps"
    if saved.get(steps) != current.get(steps) and horizon_matters(current):
        lines.append(f"{steps} = {current.get(steps)!r} but the checkpoint was trained with {saved.get(steps)!r}, "
                     "and the learning-rate decay is spread over training.steps (stop by signal, or set "
                     "--lr_scheduler.decay_ratio 0, to stop early exactly)")
    return lines
