"""Checks a run's configuration and checkpoint choice before torchrun starts any process.

    python -m torchtitan_rng.launch.preflight --job.config_file F [overrides]

Exit 0 when the run can start; 2 with one line naming the problem otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torchtitan_rng.checkpoint.layout import CheckpointError, resolve_checkpoint
from torchtitan_rng.checkpoint.resume import world_size_changed
from torchtitan_rng.checkpoint.safe_load import inspect_checkpoint
from torchtitan_rng.config import ConfigError, JobConfig, as_flags, parse_args
from torchtitan_rng.invariant.setup import check_batch_layout
from torchtitan_rng.launch import preemption
from torchtitan_rng.train_spec import get_train_spec


def check(config: JobConfig, world_size: int | None = None) -> None:
    """Raise ConfigError/CheckpointError for anything that would stop the run once started; the
    checkpoint it would resume from must be complete and (when ``world_size`` is known) fit it."""
    get_train_spec(config)
    preemption.signal_numbers(config.signals.checkpoint_on)
    if config.parallelism.world_size_invariant and world_size is not None:
        check_batch_layout(config, world_size)
    ckpt = config.checkpoint
    if ckpt.enable:
        path = resolve_checkpoint(Path(config.job.dump_folder) / ckpt.folder, ckpt.load_step, ckpt.initial_load_path)
        if path is not None:
            info = inspect_checkpoint(path)  # also checks every shard file
            if world_size is not None:
                world_size_changed(info, world_size, ckpt.on_world_size_change,
                                   config.parallelism.world_size_invariant)


def main(argv: list[str] | None = None) -> int:
    try:
        check(parse_args(sys.argv[1:] if argv is None else argv))
    except (ConfigError, CheckpointError) as err:
        print(f"error: {as_flags(str(err))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
