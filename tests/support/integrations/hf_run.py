"""One training run with ExactResumeTrainer (or, with --stock, transformers.Trainer), CPU, 1 or more
processes (torchrun). Writes every optimizer step's exact micro-batch losses to OUT/losses_rank{r}.txt."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
import transformers

from tests.support.integrations.common import NoisyDataset, TinyNet, record_step


class HFNet(TinyNet):
    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.loss(x, labels)}


class Record(transformers.TrainerCallback):
    def __init__(self, out: Path, model: HFNet, signal_at: int) -> None:
        self.out, self.model, self.signal_at = out, model, signal_at

    def on_step_end(self, args, state, control, **kwargs) -> None:  # type: ignore[no-untyped-def]
        record_step(self.out, args.process_index, state.global_step, self.model)
        if state.global_step == self.signal_at and args.process_index == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice arriving during this step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stock", action="store_true")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--ga", type=int, default=1)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--save-steps", type=int, default=1000)
    parser.add_argument("--signal-at", type=int, default=-1)
    parser.add_argument("--resume", action="store_true")
    opts = parser.parse_args()

    transformers.set_seed(0)
    model = HFNet()
    args = transformers.TrainingArguments(
        output_dir=str(opts.out / "ckpt"), use_cpu=True, per_device_train_batch_size=2,
        gradient_accumulation_steps=opts.ga, max_steps=opts.max_steps, learning_rate=0.05,
        lr_scheduler_type="constant", save_strategy="steps", save_steps=opts.save_steps, logging_steps=1000,
        dataloader_num_workers=opts.workers, report_to=[], seed=0, disable_tqdm=True,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
    )
    if opts.stock:
        trainer_class = transformers.Trainer
    else:
        from torchtitan_rng.integrations.hf import ExactResumeTrainer

        trainer_class = ExactResumeTrainer
    trainer = trainer_class(model=model, args=args, train_dataset=NoisyDataset(24),
                            callbacks=[Record(opts.out, model, opts.signal_at)])
    trainer.train(resume_from_checkpoint=True if opts.resume else None)


if __name__ == "__main__":
    main()
