"""Test support: one torchtitan 0.3 training process on the CPU (what torchrun starts in the tests).

``python torchtitan_run.py --module torchtitan_cpu --config tiny_llama [torchtitan flags]``: the CPU
adjustments of ``torchtitan_cpu`` (test support only), then torchtitan's own entry point, unchanged.
"""

import torchtitan_cpu

torchtitan_cpu.apply()

from torchtitan.train import main  # noqa: E402  (after the adjustments)

if __name__ == "__main__":
    main()
