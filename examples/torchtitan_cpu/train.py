"""torchtitan 0.3's own training entry point on a CPU: the CPU adjustments (cpu_adjustments.py), then
``torchtitan.train.main``, unchanged. Started as torchtitan's is, under torchrun:

    torchrun --nproc_per_node 2 examples/torchtitan_cpu/train.py --module tiny_configs --config tiny_llama [flags]

This folder is first on the path, so ``--module tiny_configs`` names tiny_configs.py here.
"""

import cpu_adjustments

cpu_adjustments.apply()

from torchtitan.train import main  # noqa: E402  (after the adjustments)

if __name__ == "__main__":
    main()
