"""An ExactResume loop with 2 loader workers, for tests/e2e/test_own_loop_signals.py and
tests/e2e/test_own_loop_moments.py: under torchrun (DDP over gloo), or alone as one plain process.

    torchrun --nproc-per-node 2 -m tests.support.own_loop_stop OUT STEPS [--signal-at K] [--no-restore]
    python -m tests.support.own_loop_stop OUT STEPS [--interval N] [--signing-key-env NAME] ...

With ``--signal-at K`` rank 0 sends SIGTERM to its whole process group (torchrun, every rank, every loader
worker) during step K, as a cluster ending the job does. The fault-injection points of the environment
(``TORCHTITAN_RNG_FAULT``) hold the loop where a test asks: ``before_step``, ``data_loading`` (the loader's
workers, in ``__getitem__``) and the save points. Each rank logs its exit in OUT/exits; a checkpoint the
loop refuses is one line on stderr and exit 2, as a user's script would report it.
"""

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torchtitan_rng
from torchtitan_rng.errors import TorchtitanRngError
from torchtitan_rng.fault_injection import FaultInjector, held_samples


class Jittered(torchtitan_rng.SampleRandomDataset):
    def __init__(self) -> None:
        super().__init__(0, "jitter")

    def __len__(self) -> int:
        return 40

    def __getitem__(self, key: int) -> torch.Tensor:
        return torch.randn(8, generator=self.sample_generator(key))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--signal-at", type=int, default=0)
    parser.add_argument("--interval", type=int, default=100)
    parser.add_argument("--signing-key-env", default="")
    parser.add_argument("--no-restore", action="store_true", help="the control: leave restore_rng() out")
    args = parser.parse_args()
    distributed = "WORLD_SIZE" in os.environ  # under torchrun
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    faults = FaultInjector.from_env(rank)
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.Linear(32, 1))
    if distributed:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = torchtitan_rng.build_dataloader(held_samples(Jittered(), rank), batch_size=4, seed=0, num_workers=2,
                                             sample_keys=True)
    try:
        with torchtitan_rng.ExactResume(args.out / "checkpoint", model=model, optimizer=optimizer,
                                        dataloader=loader, interval=args.interval, seed=0,
                                        stop_signals=("SIGTERM", "SIGUSR1"),
                                        signing_key_env=args.signing_key_env) as exact:
            exact.manager.hooks = faults  # the save's hold points
            start = exact.load()
            batches = iter(loader)
            if not args.no_restore:
                exact.restore_rng()
            for step in range(start + 1, args.steps + 1):
                if faults is not None:
                    faults.at("before_step", step)
                loss = model(next(batches)).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                loss = loss.detach()
                if distributed:
                    dist.all_reduce(loss)
                if rank == 0:
                    with (args.out / "loss_log.jsonl").open("a") as log:
                        log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
                    if step == args.signal_at:
                        os.killpg(os.getpgrp(), signal.SIGTERM)
                exact.maybe_save(step, last_step=args.steps)
                if exact.should_stop(step):
                    break
    except TorchtitanRngError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if distributed:
        dist.destroy_process_group()
    with (args.out / "exits").open("a") as exits:
        exits.write(f"rank {rank} left the loop after step {exact.step}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
