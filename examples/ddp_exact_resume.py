"""A plain DistributedDataParallel loop made to resume exactly (CPU, gloo).

    torchrun --nproc-per-node 2 examples/ddp_exact_resume.py --out run --steps 12
    torchrun --nproc-per-node 2 examples/ddp_exact_resume.py --out run --steps 24   # resumes at step 12

The toy task has every usual source of randomness: a shuffled loader with two worker processes, a random
transform (jitter) on every sample, and dropout. Four torchtitan_rng calls make a stopped-and-resumed
run write the same losses, bit for bit, as a run never stopped: build_dataloader, ExactResume, load,
restore_rng (plus maybe_save in the loop). ``--control`` leaves restore_rng out to show what it does.

``with ExactResume(...)`` ends the loader's workers before the process group goes, and ``stop_signals`` with
``should_stop`` turns SIGTERM or SIGUSR1 (a cluster ending the job: torchrun passes it to every rank)
into a checkpoint at one step agreed by all ranks; the same command then resumes from it.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torchtitan_rng

SEED = 0


class JitteredBlobs(torchtitan_rng.SampleRandomDataset):
    """Two classes of points; each sample gets fresh Gaussian jitter, drawn from its own stream."""

    def __init__(self, num_samples: int = 96) -> None:
        super().__init__(SEED, "jitter")
        points = torch.randn(num_samples, 16, generator=torch.Generator().manual_seed(1234))
        self.points, self.labels = points, (points.sum(dim=1) > 0).long()

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, key: int):
        # The loader passes a sample key (epoch * len + index): the jitter of a sample differs between
        # epochs and is the same after a resume, whichever worker draws it.
        _, index = self.epoch_and_index(key)
        jitter = torch.randn(16, generator=self.sample_generator(key))
        return self.points[index] + 0.3 * jitter, self.labels[index]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True, help="last step of this run")
    parser.add_argument("--control", action="store_true", help="leave restore_rng() out")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)  # the same initial weights on every rank
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = torchtitan_rng.build_dataloader(JitteredBlobs(), batch_size=8, seed=SEED, num_workers=2)
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "loss_log.jsonl").open("a") if rank == 0 else None
    with torchtitan_rng.ExactResume(args.out / "checkpoint", model=model, optimizer=optimizer, dataloader=loader,
                                    interval=4, seed=SEED, stop_signals=("SIGTERM", "SIGUSR1")) as exact:
        start = exact.load()  # 0 on a fresh run
        batches = iter(loader)
        if not args.control:
            exact.restore_rng()  # last thing before the first step

        for step in range(start + 1, args.steps + 1):
            inputs, labels = next(batches)
            loss = F.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            if log:
                log.write(json.dumps({"step": step, "loss": float(mean_loss / world)}) + "\n")
                log.flush()
            exact.maybe_save(step, last_step=args.steps)
            if exact.should_stop(step):  # a stop signal reached some rank: every rank saved this step
                print(f"rank {rank}: stopped at step {step}; run the same command again to resume", flush=True)
                break

    if log:
        log.close()
    dist.destroy_process_group()  # after the with block: the workers are gone

if __name__ == "__main__":
    main()
