"""Entry point: ``python train.py --job.config_file F [--section.key value ...]`` (or via run_train.sh)."""

import sys

from torchtitan_rng.trainer import main

if __name__ == "__main__":
    sys.exit(main())
