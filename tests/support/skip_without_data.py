"""A control for the skip tests, loaded with ``--job.custom_module tests.support.skip_without_data``: a "skip"
done wrong, that at a skipped step loads no data and draws no random number (it only advances the schedule), so
the steps after it train on the skipped step's samples. The real skip must differ from it."""

from __future__ import annotations

from typing import Any, Iterator

from torchtitan_rng import trainer

_trained_step = trainer.Trainer._step


def _step_without_data(self: trainer.Trainer, step: int, batches: Iterator[dict[str, Any]]) -> dict[str, Any]:
    if step not in self.skipped_steps:
        return _trained_step(self, step, batches)
    lr = self.parts.lr_scheduler.get_last_lr()[0]
    self.parts.lr_scheduler.step()
    return {"step": step, "loss": float("nan"), "lr": lr, "skipped": True}


trainer.Trainer._step = _step_without_data  # type: ignore[method-assign]
