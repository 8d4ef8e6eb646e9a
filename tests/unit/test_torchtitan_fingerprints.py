"""The torchtitan plug-in's recorder around torchtitan's model (``integrations/torchtitan/fingerprints.py``): the names
it records under, and the pipeline metadata inference's module calls left out. The runs through torchrun, with
compare_losses naming what differs: tests/e2e/test_torchtitan_locator.py (slow tier)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("torchtitan")


def _stage(first: int) -> nn.Module:
    """A pipeline stage as torchtitan builds one: its layers under their numbers in the whole model, each wrapped
    for activation checkpointing."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    stage = nn.Module()
    stage.layers = nn.ModuleDict({str(first + i): checkpoint_wrapper(nn.Linear(4, 4)) for i in range(2)})
    return stage


def test_parameters_and_modules_are_named_as_the_model_names_them() -> None:
    from torchtitan_rng.integrations.torchtitan.fingerprints import _ModelParts

    parts = [_stage(0), _stage(2)]
    model = _ModelParts(parts)
    # The state dict's names (the wrapper's own part dropped), every stage's, in order.
    assert [name for name, _ in model.named_parameters()] == [name for part in parts for name in part.state_dict()]
    assert [name for name, _ in model.named_parameters()][:2] == ["layers.0.weight", "layers.0.bias"]
    modules = [name for name, _ in model.named_modules() if name]
    assert modules == ["layers", "layers.0", "layers.1", "layers", "layers.2", "layers.3"]
    assert len(list(model.parameters())) == 8  # parameters() goes through the same names


def test_metadata_inference_leaves_no_module_calls(tmp_path: Path) -> None:
    from torchtitan_rng.config import Debug
    from torchtitan_rng.diagnosis.tensor_fingerprints import TensorFingerprints
    from torchtitan_rng.integrations.torchtitan.fingerprints import _ModelParts, _without_module_calls

    stage = _stage(0)
    prints = TensorFingerprints(Debug(tensor_fingerprint=True, fingerprint_modules_at_step=1), _ModelParts([stage]),
                                None, rank=0, world_size=1, dump_folder=tmp_path)
    prints.step_begin(1)
    inferred = _without_module_calls(prints, lambda x: stage.layers["1"](stage.layers["0"](x)))
    inferred(torch.empty(2, 4))  # the shapes' forward, on memory never written
    assert prints.record["modules"] == []
    stage.layers["0"](torch.ones(2, 4))  # the step's own forward: recorded
    assert [call[0] for call in prints.record["modules"]] == ["layers.0"]
    prints.close()
