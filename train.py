"""``python train.py --job.config_file F [--section.key value ...]``: the same as ``python -m torchtitan_rng.train``."""

import sys

from torchtitan_rng.train import main

if __name__ == "__main__":
    sys.exit(main())
