"""One training run with ExactResumeTrainer (or, with --stock, transformers.Trainer), CPU, 1 or more
processes (torchrun). Writes every optimizer step's exact micro-batch losses to OUT/losses_rank{r}.txt and
the epoch it logs to OUT/epochs_rank{r}.txt; evaluation (--eval-steps) draws from the global streams."""

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
        if not self.training:
            torch.rand(1)  # an evaluation may draw, e.g. for a noisy metric
        return {"loss": self.loss(x, labels)}


class Record(transformers.TrainerCallback):
    def __init__(self, out: Path, model: HFNet, signal_at: int, save_at: int) -> None:
        self.out, self.model, self.signal_at, self.save_at = out, model, signal_at, save_at

    def on_step_end(self, args, state, control, **kwargs) -> None:  # type: ignore[no-untyped-def]
        record_step(self.out, args.process_index, state.global_step, self.model)
        with open(self.out / f"epochs_rank{args.process_index}.txt", "a") as f:
            f.write(f"{state.global_step} {float(state.epoch).hex()}\n")
        if state.global_step == self.signal_at and args.process_index == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice arriving during this step
        if state.global_step == self.save_at:  # a user's own save
            control.should_save = True


def train(opts: argparse.Namespace, out: Path, resume: bool | str | None) -> None:
    transformers.set_seed(0)
    model = HFNet()
    evaluation = {"eval_strategy": "steps", "eval_steps": opts.eval_steps} if opts.eval_steps else {}
    args = transformers.TrainingArguments(
        output_dir=str(out / "ckpt"), use_cpu=True, per_device_train_batch_size=2,
        gradient_accumulation_steps=opts.ga, max_steps=opts.max_steps, learning_rate=0.05,
        lr_scheduler_type="constant", save_strategy="steps", save_steps=opts.save_steps, logging_steps=1000,
        dataloader_num_workers=opts.workers, report_to=[], seed=0, disable_tqdm=True,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None, enable_jit_checkpoint=opts.jit, **evaluation,
    )
    extra = {}
    if opts.stock:
        trainer_class = transformers.Trainer
    else:
        from torchtitan_rng.integrations.hf import ExactResumeTrainer

        trainer_class = ExactResumeTrainer
        if opts.no_eval_fork:  # the control: evaluation moving the streams, as the stock Trainer's does
            class ExactResumeTrainer(ExactResumeTrainer):  # type: ignore[no-redef]
                evaluate = transformers.Trainer.evaluate

            trainer_class = ExactResumeTrainer
        if opts.on_stock_checkpoint:
            extra["on_stock_checkpoint"] = opts.on_stock_checkpoint
    trainer = trainer_class(model=model, args=args, train_dataset=NoisyDataset(24),
                            eval_dataset=NoisyDataset(4) if opts.eval_steps else None,
                            callbacks=[Record(out, model, opts.signal_at, opts.save_at)], **extra)
    trainer.train(resume_from_checkpoint=resume)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stock", action="store_true")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--ga", type=int, default=1)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--save-steps", type=int, default=1000)
    parser.add_argument("--eval-steps", type=int, default=0)
    parser.add_argument("--no-eval-fork", action="store_true")
    parser.add_argument("--jit", action="store_true", help="enable_jit_checkpoint=True")
    parser.add_argument("--on-stock-checkpoint")
    parser.add_argument("--signal-at", type=int, default=-1)
    parser.add_argument("--save-at", type=int, default=-1, help="a user callback asks for a checkpoint at this step")
    parser.add_argument("--resume", nargs="?", const=True, help="the newest checkpoint, or this one")
    parser.add_argument("--again", type=Path, help="then a second train() in this process, into this folder")
    parser.add_argument("--sigterm-after", action="store_true", help="then SIGTERM to itself, outside training")
    opts = parser.parse_args()

    train(opts, opts.out, opts.resume)
    if opts.again:
        opts.signal_at = -1
        train(opts, opts.again, None)
    if opts.sigterm_after:
        os.kill(os.getpid(), signal.SIGTERM)
        (opts.out / "survived_sigterm").write_text("")


if __name__ == "__main__":
    main()
