"""The HuggingFace Trainer resuming bit for bit: one job script for the first launch and every resumption.

    python examples/hf_exact_resume.py --out run                  # 12 steps, uninterrupted
    python examples/hf_exact_resume.py --out stopped --stop-at 5  # stopped by a SIGTERM during step 5
    python examples/hf_exact_resume.py --out stopped              # the same command: resumed to step 12
    python -m torchtitan_rng.compare_losses run stopped           # identical

``train(resume_from_checkpoint=True)`` starts afresh when ``OUT/checkpoints`` holds no checkpoint yet and
resumes the newest one otherwise. A SIGTERM (or SIGUSR1), as a scheduler sends before it preempts a job, saves a
checkpoint at the next step every process agrees on and stops: ``trainer.stopped_by`` names the signal, and the
script exits 0 with the checkpoint saved. ``--stop-at K`` sends that SIGTERM to this process during step K,
standing in for the scheduler. Every step's loss goes to ``OUT/loss_log.jsonl`` (``{"step": N, "loss": X}``, the
form ``python -m torchtitan_rng.compare_losses`` reads; a resumed run appends, and a step written twice counts
once, the later line). The samples draw noise from Python's, NumPy's and torch's global streams and the model
has dropout: every stream matters. Runs on the CPU; under torchrun on several processes as well.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
from pathlib import Path

import numpy as np
import torch
import transformers
from torch import nn

from torchtitan_rng.integrations.hf import ExactResumeTrainer


class NoisySamples(torch.utils.data.Dataset):
    """Fixed inputs plus noise drawn when a sample is loaded, from all three global streams."""

    def __init__(self, size: int = 48) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(size, 8, generator=generator), torch.randn(size, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        noise = torch.rand(8) * 0.1 + float(np.random.rand()) * 0.1 + random.random() * 0.1
        return {"x": self.x[index] + noise, "labels": self.y[index]}


class Regressor(nn.Module):
    """A small network with dropout; keeps its last training loss for the loss log."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 1))
        self.last_loss = 0.0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = nn.functional.mse_loss(self.body(x), labels)
        self.last_loss = float(loss.detach())
        return {"loss": loss}


class LossLog(transformers.TrainerCallback):
    """Process 0 appends each optimizer step's loss to ``loss_log.jsonl``; a SIGTERM during step ``stop_at``."""

    def __init__(self, out: Path, model: Regressor, stop_at: int) -> None:
        self.path, self.model, self.stop_at = out / "loss_log.jsonl", model, stop_at

    def on_step_end(self, args, state, control, **kwargs) -> None:  # type: ignore[no-untyped-def]
        if args.process_index == 0:
            with self.path.open("a") as log:
                log.write(json.dumps({"step": state.global_step, "loss": self.model.last_loss}) + "\n")
        if state.global_step == self.stop_at:
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the run's folder: loss log and checkpoints")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--stop-at", type=int, default=-1, help="send this process a SIGTERM during step K")
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    transformers.set_seed(0)
    model = Regressor()
    args = transformers.TrainingArguments(
        output_dir=str(opts.out / "checkpoints"), max_steps=opts.steps, per_device_train_batch_size=4,
        learning_rate=0.05, lr_scheduler_type="constant", save_strategy="steps", save_steps=4, seed=0,
        dataloader_num_workers=2, use_cpu=True, report_to=[], disable_tqdm=True, logging_steps=1000,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
    )
    trainer = ExactResumeTrainer(model=model, args=args, train_dataset=NoisySamples(),
                                 callbacks=[LossLog(opts.out, model, opts.stop_at)])
    trainer.train(resume_from_checkpoint=True)  # the first launch too: no checkpoint yet, from the start
    if trainer.stopped_by is not None:
        print(f"preempted ({trainer.stopped_by}): run the same command again to resume")
    else:
        print(f"finished: {trainer.state.global_step} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
