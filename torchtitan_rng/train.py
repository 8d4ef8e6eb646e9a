"""The trainer's entry: ``python -m torchtitan_rng.train --job.config_file F [--section.key value ...]``.

``run_train.sh`` starts it under torchrun; ``python train.py`` in a source checkout is the same. It imports
nothing heavy before the signal handlers are in place: torch takes seconds to import, and a checkpoint
signal forwarded by torchrun during that time must not kill a rank.
"""

from __future__ import annotations

import sys

from torchtitan_rng.config import parse_args, usage
from torchtitan_rng.errors import TorchtitanRngError, report
from torchtitan_rng import signals
from torchtitan_rng.launch import orphans


def main(argv: list[str] | None = None) -> int:
    orphans.die_with_launcher()
    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        print(usage("python -m torchtitan_rng.train"))
        return 0
    signals.install()
    try:
        config = parse_args(args)
        signals.install(config.signals.checkpoint_on)
    except TorchtitanRngError as err:
        return report(err)

    from torchtitan_rng.trainer import run

    return run(config)


if __name__ == "__main__":
    sys.exit(main())
