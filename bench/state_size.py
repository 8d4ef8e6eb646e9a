"""Benchmark 4: bytes of RNG + train state + dataloader state per rank, as stored in the checkpoint (target:
<= 64 KiB per rank plus O(workers)).

For each worker count, the loader of each of 2 data-parallel ranks runs a few batches; then the per-rank
values the checkpoint holds are measured: TrainState's ``rank_{r}`` (every global stream of the rank) and
the dataloader's ``dp_rank_{r}`` (sampler position, worker seeds and per-worker state), plus the shared
step counter and learning-rate schedule.

    python -m bench.state_size [--quick] [--config train_configs/llama_debug.toml]
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from bench.common import DEBUG_CONFIG, parser, table
from torchtitan_rng import device as device_lib
from torchtitan_rng.config import parse_args
from torchtitan_rng.data.dataloader import ResumableDataLoader
from torchtitan_rng.lr_scheduler import build_lr_scheduler
from torchtitan_rng.models import get_train_spec
from torchtitan_rng.checkpoint.train_state import TrainState

DP_WORLD = 2
BUDGET = 64 * 1024


def _bytes(value: object) -> int:
    return len(value) if isinstance(value, bytes) else len(pickle.dumps(value))


def main() -> None:
    args = parser(__doc__.splitlines()[0])
    args.add_argument("--config", type=Path, default=DEBUG_CONFIG, help="the training config (its model and data)")
    args = args.parse_args()
    worker_counts = (0, 2, 4) if args.quick else (0, 1, 2, 4, 8)
    config = parse_args(["--job.config_file", str(args.config)])
    spec = get_train_spec(config)
    dataset = spec.build_dataset(config)
    device = device_lib.device_for_rank(0)
    shared = _bytes(build_lr_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), config).state_dict()) + 8
    rows = []
    for workers in worker_counts:
        for rank in range(DP_WORLD):
            loader = ResumableDataLoader(dataset, batch_size=config.training.local_batch_size, dp_rank=rank,
                                         dp_world=DP_WORLD, seed=config.debug.seed, num_workers=workers)
            batches = iter(loader)
            for _ in range(3):
                next(batches)
            rng = sum(_bytes(v) for k, v in TrainState(device, rank, DP_WORLD).state_dict().items() if k != "step")
            data = sum(_bytes(v) for v in loader.state_dict().values())
            del batches
            total = rng + data
            rows.append([workers, rank, rng, data, total, f"{total / 1024:.1f} KiB",
                         "yes" if total <= BUDGET + 16 * 1024 * workers else "NO"])
    table(
        f"Benchmark 4: per-rank state in a checkpoint ({config.model.name} {config.model.flavor}, {DP_WORLD} ranks; "
        f"shared by all ranks: step + lr schedule, {shared} bytes)",
        ["workers", "rank", "RNG + train state bytes", "dataloader bytes", "total bytes", "total",
         "<= 64 KiB + 16 KiB x workers"],
        rows,
    )


if __name__ == "__main__":
    main()
