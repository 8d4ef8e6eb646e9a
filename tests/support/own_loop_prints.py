"""An own loop (ExactResume) with tensor fingerprints on, and a fault to inject: the tensor locator's e2e runs.

    python tests/support/own_loop_prints.py --out DIR --steps N [--skip-batch-at K] [--noisy] [--max-norm X]

A small network with dropout, a shuffled loader, gradient clipping by ``--max-norm`` (recorded in ExactResume's
``config``; a resume may change it: ``allow_changes``). Process 0 appends each step's loss (the mean over the
processes) to ``DIR/loss_log.jsonl``; the fingerprints go beside it. Faults: ``--skip-batch-at K`` takes one
batch more entering step K (the data order); ``--noisy`` adds noise from an OS-seeded generator to the first
layer's output (a non-deterministic operation).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

from torchtitan_rng import ExactResume, build_dataloader
from tests.support.divergences import make_noisy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--skip-batch-at", type=int, default=0)
    parser.add_argument("--noisy", action="store_true")
    parser.add_argument("--max-norm", type=float, default=0.05)
    args = parser.parse_args()
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
    if args.noisy:
        make_noisy(net[0])
    model = DistributedDataParallel(net) if distributed else net
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    points = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    loader = build_dataloader(TensorDataset(points, (points.sum(dim=1) > 0).long()), batch_size=4, seed=0)
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "loss_log.jsonl").open("a") if rank == 0 else None
    with ExactResume(args.out / "checkpoint", model=model, optimizer=optimizer, dataloader=loader, interval=100,
                     seed=0, config={"max_norm": args.max_norm}, tensor_fingerprint=True,
                     fingerprint_modules_at_step=1) as exact:
        start = exact.load(allow_changes=["max_norm"])
        batches = iter(loader)
        exact.restore_rng()
        for step in range(start + 1, args.steps + 1):
            if step == args.skip_batch_at:
                next(batches)
            inputs, labels = next(batches)
            loss = F.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            exact.fingerprint((inputs, labels), loss)  # after the backward, before clipping
            nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
            optimizer.step()
            mean = loss.detach().clone()
            if distributed:
                dist.all_reduce(mean)
            if log is not None:
                log.write(json.dumps({"step": step, "loss": float(mean / world)}) + "\n")
                log.flush()
            exact.maybe_save(step, last_step=args.steps)
    if log is not None:
        log.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
