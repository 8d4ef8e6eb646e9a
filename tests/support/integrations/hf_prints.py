"""One ExactResumeTrainer run with tensor_fingerprint=True, and a fault to inject: the tensor locator's e2e runs.

    python -m tests.support.integrations.hf_prints --out DIR --max-steps N [--data-seed S] [--noisy]
        [--max-grad-norm X]

A small regressor with dropout; process 0 appends each optimizer step's loss to ``DIR/loss_log.jsonl`` and the
fingerprints go beside it (``dump_folder``); checkpoints every 3 steps in ``DIR/checkpoints``, resumed by the
same command with a larger ``--max-steps``. Faults: ``--data-seed`` another sample order; ``--noisy`` noise from
an OS-seeded generator on the first layer's output; ``--max-grad-norm`` another clipping (at a resume).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import transformers
from torch import nn

from torchtitan_rng.integrations.hf import ExactResumeTrainer
from tests.support.divergences import make_noisy


class Samples(torch.utils.data.Dataset):
    def __init__(self, size: int = 48) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(size, 8, generator=generator), torch.randn(size, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "labels": self.y[index]}


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 1))
        self.last_loss = 0.0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = nn.functional.mse_loss(self.body(x), labels)
        self.last_loss = float(loss.detach())
        return {"loss": loss}


class LossLog(transformers.TrainerCallback):
    def __init__(self, out: Path, model: Regressor) -> None:
        self.path, self.model = out / "loss_log.jsonl", model

    def on_step_end(self, args, state, control, **kwargs) -> None:  # type: ignore[no-untyped-def]
        if args.process_index == 0:
            with self.path.open("a") as log:
                log.write(json.dumps({"step": state.global_step, "loss": self.model.last_loss}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--noisy", action="store_true")
    parser.add_argument("--max-grad-norm", type=float, default=0.05)
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    transformers.set_seed(0)
    model = Regressor()
    if opts.noisy:
        make_noisy(model.body[0])
    args = transformers.TrainingArguments(
        output_dir=str(opts.out / "checkpoints"), max_steps=opts.max_steps, per_device_train_batch_size=4,
        learning_rate=0.05, lr_scheduler_type="constant", save_strategy="steps", save_steps=3, seed=0,
        data_seed=opts.data_seed, max_grad_norm=opts.max_grad_norm, use_cpu=True, report_to=[], disable_tqdm=True,
        logging_steps=1000, ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
    )
    trainer = ExactResumeTrainer(model=model, args=args, train_dataset=Samples(), callbacks=[LossLog(opts.out, model)],
                                 tensor_fingerprint=True, fingerprint_modules_at_step=1, dump_folder=opts.out)
    trainer.train(resume_from_checkpoint=True)


if __name__ == "__main__":
    main()
