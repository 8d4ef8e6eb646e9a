"""Entry point: ``python train.py --job.config_file F [--section.key value ...]`` (or via run_train.sh)."""

import sys

from torchtitan_rng import preemption
from torchtitan_rng.config import ConfigError, parse_args

if __name__ == "__main__":
    # Before torch is imported (seconds): a checkpoint signal forwarded during start-up must not kill a
    # rank, and a mistyped option is reported at once.
    preemption.install()
    try:
        preemption.install(parse_args(sys.argv[1:]).signals.checkpoint_on)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)

    from torchtitan_rng.trainer import main

    sys.exit(main())
