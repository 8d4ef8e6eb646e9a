"""The loss log (``loss_log.jsonl`` in torchtitan's dump folder, this project's format) of a torchtitan run."""

from __future__ import annotations

from typing import Any

from torchtitan.components.metrics import _get_metrics_rank

from torchtitan_rng.distributed import rank_and_world_size
from torchtitan_rng.loss_log import LossLogWriter, loss_log_path


def attach_loss_log(trainer: Any) -> LossLogWriter | None:
    """Record each step torchtitan logs into ``{dump_folder}/loss_log.jsonl``, on the rank torchtitan logs
    metrics from (the one that holds the loss: under pipeline parallelism the other stages log -1.0); None
    on every other rank. The trainer's ``metrics_processor.log`` receives the step's float32
    ``global_avg_loss`` (as a Python float, the same value TensorBoard stores); the instance's method is
    replaced, not the object wrapped, because the trainer assigns the processor's attributes."""
    rank = rank_and_world_size()[0]
    writer_rank = _get_metrics_rank(parallel_dims=trainer.parallel_dims,
                                    pp_schedule=trainer.config.parallelism.pipeline_parallel_schedule)
    if rank != writer_rank:
        return None
    writer = LossLogWriter(loss_log_path(trainer.config.dump_folder))
    processor = trainer.metrics_processor
    log = processor.log

    def log_and_record(step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
                       extra_metrics: dict[str, Any] | None = None) -> Any:
        # llama3's trainer logs "lr/<optimizer>", Flux's "lr".
        lr = next((value for key, value in (extra_metrics or {}).items() if key == "lr" or key.startswith("lr/")),
                  None)
        writer.write({"step": step, "loss": global_avg_loss, "lr": lr, "grad_norm": grad_norm})
        writer.flush()  # host floats already: no device sync; fsynced, so a kill loses no logged step
        return log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)

    processor.log = log_and_record
    return writer
