"""The restore-order experiment of the HuggingFace Trainer report, written against torchtitan_rng.

The report: a dataset whose ``__getitem__`` draws from the global RNG, and a model with dropout. Restoring
the RNG *after* fetching the first resumed batch (Trainer's order, "get first") makes that batch and the
dropout after it differ from an uninterrupted run; restoring *before* ("load first") reproduces it.

With torchtitan_rng nothing has to be skipped to find the resume position (the loader saves it), so
restore_rng() can sit at the step boundary; called after a batch was fetched, it refuses with
RestoreOrderError instead of training on a different batch.

    python examples/restore_order.py --out run --steps 3     # stops after step 3 (checkpoint)
    python examples/restore_order.py --out run --steps 6     # resumes: steps 4..6 as if never stopped
    python examples/restore_order.py --out run --steps 6 --order get_first   # RestoreOrderError
    python examples/restore_order.py --out run --steps 6 --control           # no restore: steps differ
"""

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import torchtitan_rng

SEED = 42


class RandomTransformDataset(Dataset):
    """The user's dataset, unchanged: its noise comes from the global torch RNG."""

    def __init__(self, base: Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        data, label = self.base[index]
        return data + torch.rand(data.shape) * 0.001, label


class SimpleModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(10, 10)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.linear(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True, help="last step of this run")
    parser.add_argument("--order", choices=["load_first", "get_first"], default="load_first")
    parser.add_argument("--control", action="store_true", help="leave restore_rng() out")
    args = parser.parse_args()

    torch.manual_seed(SEED)
    np.random.seed(SEED)
    random.seed(SEED)
    base = TensorDataset(torch.randn(100, 10), torch.randn(100, 10))
    model = SimpleModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torchtitan_rng.build_dataloader(RandomTransformDataset(base), batch_size=10, seed=SEED)
    exact = torchtitan_rng.ExactResume(args.out / "checkpoint", model=model, optimizer=optimizer,
                                       dataloader=loader, interval=3, seed=SEED)
    start = exact.load()
    batches = iter(loader)
    first = next(batches) if args.order == "get_first" else None  # Trainer's order: fetch, then restore
    if not args.control:
        exact.restore_rng()  # with --order get_first: RestoreOrderError

    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "loss_log.jsonl").open("a") as log:
        for step in range(start + 1, args.steps + 1):
            inputs, targets = first if first is not None else next(batches)
            first = None
            output = model(inputs)
            loss = nn.functional.mse_loss(output, targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            # The report compared the step's output; the loss log holds its sum and the loss, bit for bit.
            log.write(json.dumps({"step": step, "loss": float(loss), "output_sum": float(output.sum())}) + "\n")
            exact.maybe_save(step, last_step=args.steps)


if __name__ == "__main__":
    main()
