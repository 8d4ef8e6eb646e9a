"""The plug-in's pre-split pipeline step on torch 2.13 (``provide_presplit_step``): torchtitan 0.3.0 hands the
schedules its own micro-batches (``step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``), which torch 2.13's
``step`` reads as whole-batch model inputs. Given the micro-batches torch's own split makes, the stand-in
trains bit for bit as torch's whole-batch step does, on a real one-process gloo group and real pipeline
stages, with a single-stage (1F1B) and a looped (Interleaved1F1B) schedule. The launches (pipeline parallel 2
with torchtitan): tests/e2e/test_torchtitan_plugin.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("torchtitan")

MICROBATCHES = 2


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _schedule(looped: bool) -> tuple[Any, list[torch.nn.Module]]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    import torchtitan_rng.integrations.torchtitan  # noqa: F401  (provides the pre-split step on import)

    torch.manual_seed(0)
    parts = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)) for _ in range(2 if looped else 1)]
    stages = [PipelineStage(part, stage_index=i, num_stages=len(parts), device=torch.device("cpu"))
              for i, part in enumerate(parts)]
    loss = F.mse_loss
    if looped:
        return ScheduleInterleaved1F1B(stages, n_microbatches=MICROBATCHES, loss_fn=loss), parts
    return Schedule1F1B(stages[0], n_microbatches=MICROBATCHES, loss_fn=loss), parts


def _trained(looped: bool, presplit: bool) -> list[torch.Tensor]:
    """Losses and gradients of one step (dropout draws from the global stream, seeded alike for both)."""
    schedule, parts = _schedule(looped)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    losses: list[torch.Tensor] = []
    torch.manual_seed(1)
    if presplit:
        schedule.step(arg_mbs=[(chunk,) for chunk in x.chunk(MICROBATCHES)], kwarg_mbs=[{}] * MICROBATCHES,
                      target_mbs=list(y.chunk(MICROBATCHES)), losses=losses)
    else:
        schedule.step(x, target=y, losses=losses)
    return [loss.detach() for loss in losses] + [p.grad for part in parts for p in part.parameters()]


@pytest.mark.parametrize("looped", [False, True], ids=["1F1B", "Interleaved1F1B"])
def test_presplit_microbatches_train_as_torchs_own_split(group: None, looped: bool) -> None:
    whole, presplit = _trained(looped, presplit=False), _trained(looped, presplit=True)
    assert len(whole) == len(presplit) and all(torch.equal(a, b) for a, b in zip(whole, presplit))
    # Control: other micro-batches (the halves swapped) give other losses, so the comparison can fail.
    schedule, _ = _schedule(looped)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    swapped: list[torch.Tensor] = []
    torch.manual_seed(1)
    schedule.step(arg_mbs=[(chunk,) for chunk in reversed(x.chunk(MICROBATCHES))],
                  target_mbs=list(reversed(y.chunk(MICROBATCHES))), losses=swapped)
    assert not torch.equal(swapped[0], whole[0])


def test_provided_only_where_torchs_own_step_refuses_the_presplit_call(group: None) -> None:
    import inspect

    schedule, _ = _schedule(looped=False)
    own = getattr(type(schedule).step, "__wrapped__", None)
    if own is None:  # a torch with the pre-split step: its own is kept
        assert "arg_mbs" in inspect.signature(type(schedule).step).parameters
        return
    assert "arg_mbs" not in inspect.signature(own).parameters
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    # torch 2.13 reads the micro-batch lists as whole-batch model inputs: the model refuses them here,
    # torchtitan's run stops with "ValueError: Expecting 2 arg_mbs but got 1".
    with pytest.raises((TypeError, ValueError), match="arg_mbs"):
        own(schedule, arg_mbs=[(chunk,) for chunk in x.chunk(MICROBATCHES)], kwarg_mbs=[{}] * MICROBATCHES,
            target_mbs=list(y.chunk(MICROBATCHES)), losses=[])
