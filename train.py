"""Entry point: ``python train.py --job.config_file F [--section.key value ...]`` (or via run_train.sh)."""

import sys

from torchtitan_rng import preemption

# Before torch is imported (seconds): a checkpoint signal forwarded during start-up must not kill a rank.
preemption.install()

from torchtitan_rng.trainer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
