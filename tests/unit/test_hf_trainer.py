"""ExactResumeTrainer in one process: a signal stop says so in one line and leaves a flag a script can check,
and ``train(resume_from_checkpoint=True)`` serves the first launch too (no checkpoint yet: from the start), so one
job script serves every launch. The real transformers Trainer, a real SIGTERM to this process during a step."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import transformers

from tests.support.integrations.common import NoisyDataset
from tests.support.integrations.hf_run import HFNet
from torchtitan_rng.integrations.hf import ExactResumeTrainer

STEPS = 4


class _SignalAt(transformers.TrainerCallback):
    """SIGTERM to this process during step ``at``, as a preemption notice arrives (-1: never)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def _trainer(out: Path, signal_at: int = -1, trainer_class: type = ExactResumeTrainer) -> transformers.Trainer:
    args = transformers.TrainingArguments(output_dir=str(out), use_cpu=True, per_device_train_batch_size=2,
                                          max_steps=STEPS, save_strategy="steps", save_steps=1000, report_to=[],
                                          logging_steps=1000, disable_tqdm=True, lr_scheduler_type="constant")
    return trainer_class(model=HFNet(), args=args, train_dataset=NoisyDataset(24), callbacks=[_SignalAt(signal_at)])


def test_one_job_script_for_every_launch_and_a_signal_stop_is_not_silent(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """The docs' job script, ``train(resume_from_checkpoint=True)``, launched three times into one folder: the
    first launch starts afresh (one line), a SIGTERM during step 2 stops it at step 3 with its checkpoint (one
    line, ``stopped_by``); the second resumes it to the end (``stopped_by`` None). Control: the stock Trainer
    refuses the same first launch."""
    out = tmp_path / "ckpt"
    first = _trainer(out, signal_at=2)
    with caplog.at_level(logging.WARNING, logger="torchtitan_rng.integrations.hf"):
        first.train(resume_from_checkpoint=True)
    assert f"resume_from_checkpoint=True: {out} holds no checkpoint yet; training from the start" in caplog.text
    assert first.stopped_by == "SIGTERM" and first.state.global_step == 3
    assert (f"stopped by SIGTERM at step 3: checkpoint-3 saved in {out}; train(resume_from_checkpoint=True) "
            "resumes it") in caplog.text
    assert sorted(path.name for path in out.iterdir()) == ["checkpoint-3"]
    second = _trainer(out)
    second.train(resume_from_checkpoint=True)
    assert second.stopped_by is None and second.state.global_step == STEPS
    with pytest.raises(ValueError, match="No valid checkpoint found"):
        _trainer(tmp_path / "stock", trainer_class=transformers.Trainer).train(resume_from_checkpoint=True)
