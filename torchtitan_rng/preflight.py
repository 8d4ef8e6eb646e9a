"""Checks a run's configuration and checkpoint choice before torchrun starts any process.

    python -m torchtitan_rng.preflight --job.config_file F [overrides]

Exit 0 when the run can start; 2 with one line naming the problem otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torchtitan_rng.checkpoint import CheckpointError, resolve_checkpoint
from torchtitan_rng.config import ConfigError, JobConfig, parse_args
from torchtitan_rng.train_spec import get_train_spec


def check(config: JobConfig) -> None:
    get_train_spec(config)
    ckpt = config.checkpoint
    if ckpt.enable:
        resolve_checkpoint(Path(config.job.dump_folder) / ckpt.folder, ckpt.load_step, ckpt.initial_load_path)


def main(argv: list[str] | None = None) -> int:
    try:
        check(parse_args(sys.argv[1:] if argv is None else argv))
    except (ConfigError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
