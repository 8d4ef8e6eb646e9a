"""An ExactResume loop under torchrun with 2 loader workers, for tests/e2e/test_own_loop_signals.py.

    torchrun --nproc-per-node 2 -m tests.support.own_loop_stop OUT STEPS [--signal-at K] [--no-restore]

With ``--signal-at K`` rank 0 sends SIGTERM to its whole process group (torchrun, every rank, every loader
worker) during step K, as a cluster ending the job does. Each rank logs its exit in OUT/exits.
"""

import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torchtitan_rng


class Jittered(torchtitan_rng.SampleRandomDataset):
    def __init__(self) -> None:
        super().__init__(0, "jitter")

    def __len__(self) -> int:
        return 40

    def __getitem__(self, key: int) -> torch.Tensor:
        return torch.randn(8, generator=self.sample_generator(key))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--signal-at", type=int, default=0)
    parser.add_argument("--no-restore", action="store_true", help="the control: leave restore_rng() out")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = torchtitan_rng.build_dataloader(Jittered(), batch_size=4, seed=0, num_workers=2)
    with torchtitan_rng.ExactResume(args.out / "checkpoint", model=model, optimizer=optimizer, dataloader=loader,
                                    interval=100, seed=0, stop_signals=("SIGTERM", "SIGUSR1")) as exact:
        start = exact.load()
        batches = iter(loader)
        if not args.no_restore:
            exact.restore_rng()
        for step in range(start + 1, args.steps + 1):
            loss = model(next(batches)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            dist.all_reduce(loss := loss.detach())
            if rank == 0:
                with (args.out / "loss_log.jsonl").open("a") as log:
                    log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
                if step == args.signal_at:
                    os.killpg(os.getpgrp(), signal.SIGTERM)
            exact.maybe_save(step, last_step=args.steps)
            if exact.should_stop(step):
                break
    dist.destroy_process_group()
    with (args.out / "exits").open("a") as exits:
        exits.write(f"rank {rank} left the loop after step {exact.step}\n")


if __name__ == "__main__":
    main()
