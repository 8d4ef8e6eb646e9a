"""``python train.py --job.config_file F [--section.key value ...]``: the same as ``python -m torchtitan_rng.train``."""

from torchtitan_rng.train import cli

if __name__ == "__main__":
    cli()
