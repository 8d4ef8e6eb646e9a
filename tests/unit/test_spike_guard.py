"""training.spike_guard without training: its spelling (one-line refusals), what it judges a spike, how a skipped
update is left out (bit for bit, with a control), and how the loss log writes its decision."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.support.checks import float_bits
from torchtitan_rng.config import ConfigError, SpikeRule, parse_args, parse_spike_guard
from torchtitan_rng.loss_log import LossLogWriter, read_loss_log
from torchtitan_rng.replay_step import block_of
from torchtitan_rng.skips import apply_update
from torchtitan_rng.spike_guard import SpikeGuard


@pytest.mark.parametrize(("value", "rule"), [
    ("", None),
    ("loss,factor=3", SpikeRule(("loss",), "factor", 3.0)),
    ("grad_norm, zscore=6, window=20, warmup=5", SpikeRule(("grad_norm",), "zscore", 6.0, 20, 5)),
    ("loss+grad_norm,factor=2.5,warmup=2", SpikeRule(("loss", "grad_norm"), "factor", 2.5, 50, 2)),
])
def test_spellings(value: str, rule: SpikeRule | None) -> None:
    assert parse_spike_guard(value) == rule


@pytest.mark.parametrize("value", ["loss", "lr,factor=3", "loss,factor=3,zscore=2", "loss,factor=x", "loss,factor=-1",
                                   "loss,factor=3,warmup=1", "loss,factor=3,window=4,warmup=5", "loss,ratio=3",
                                   "loss+loss,factor=3", "loss,factor=3,factor=4"])
def test_bad_values_are_one_line(value: str) -> None:
    with pytest.raises(ConfigError, match=r"training.spike_guard = .* is not valid .* e\.g\. loss,factor=3") as err:
        parse_args(["--training.spike_guard", value, "--metrics.log_samples"])
    assert "\n" not in str(err.value)


def test_the_guard_needs_the_samples_it_records() -> None:
    with pytest.raises(ConfigError, match=r"records the samples .* add --metrics.log_samples") as err:
        parse_args(["--training.spike_guard", "loss,factor=3"])
    assert "\n" not in str(err.value)
    parse_args(["--training.spike_guard", "loss,factor=3", "--metrics.log_samples"])  # control


def _judge(guard: SpikeGuard, losses: list[float], given: set[int] = frozenset()) -> list[bool]:
    return [bool(guard.judge({"loss": torch.tensor(loss), "grad_norm": torch.tensor(1.0)}, step in given))
            for step, loss in enumerate(losses, start=1)]


def test_the_guard_skips_spikes_after_its_warmup_and_keeps_them_out_of_its_window() -> None:
    rule = SpikeRule(("loss",), "factor", 3.0, window=4, warmup=2)
    guard = SpikeGuard(rule, torch.device("cpu"))
    # 4 and 5 are spikes: 5 is judged against the mean of 1-3 (had 4 entered the window, 7 would be under 3 x
    # its mean); a non-finite value is one too.
    assert _judge(guard, [2.0, 2.25, 2.0, 7.0, 7.0, 2.0, math.nan]) == [False, False, False, True, True, False, True]
    assert guard.filled == 4 and guard.values.tolist()[0] == [2.0, 2.25, 2.0, 2.0]
    # A listed skip is skipped, and its value kept out of the window as a decided one would be.
    told = SpikeGuard(rule, torch.device("cpu"))
    assert _judge(told, [2.0, 2.25, 2.0, 2.0], given={3}) == [False, False, True, False]
    assert told.filled == 3
    # No judgement before the warm-up: step 3 is judged with warmup=2 (2 values in), not with warmup=3.
    assert _judge(SpikeGuard(rule, torch.device("cpu")), [2.0, 2.0, 9.0]) == [False, False, True]
    late = SpikeRule(("loss",), "factor", 3.0, window=4, warmup=3)
    assert _judge(SpikeGuard(late, torch.device("cpu")), [2.0, 2.0, 9.0]) == [False, False, False]
    # Control: the same values with a higher factor are no spike.
    lenient = SpikeGuard(SpikeRule(("loss",), "factor", 10.0, window=4, warmup=2), torch.device("cpu"))
    assert _judge(lenient, [2.0, 2.25, 2.0, 7.0, 7.0]) == [False] * 5


def test_a_zscore_rule() -> None:
    guard = SpikeGuard(SpikeRule(("loss",), "zscore", 3.0, window=8, warmup=4), torch.device("cpu"))
    assert _judge(guard, [2.0, 2.1, 1.9, 2.0, 2.05, 2.6, 2.02]) == [False] * 5 + [True, False]


def test_the_guard_state_round_trips() -> None:
    guard = SpikeGuard(SpikeRule(("loss",), "factor", 3.0, window=4, warmup=2), torch.device("cpu"))
    _judge(guard, [1.0, 2.0, 3.0])
    other = SpikeGuard(guard.rule, torch.device("cpu"))
    other.load_state_dict({key: value.clone() for key, value in guard.state_dict().items()})
    assert _judge(other, [9.0, 2.5]) == _judge(guard, [9.0, 2.5]) == [True, False]


def _model_and_optimizer() -> tuple[torch.nn.Linear, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)


def _train(model: torch.nn.Linear, optimizer: torch.optim.AdamW, skips: list[bool | None]) -> None:
    """One step per entry on fixed data: None a plain optimizer.step(), a bool through apply_update."""
    for number, skip in enumerate(skips):
        optimizer.zero_grad()
        model(torch.full((2, 4), float(number + 1))).square().mean().backward()
        if skip is None:
            optimizer.step()
        else:
            apply_update(optimizer, torch.tensor(skip))


def _bits(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[bytes]:
    tensors = [*model.parameters(), *(v for s in optimizer.state.values() for k, v in s.items() if k != "step")]
    return [t.detach().numpy().tobytes() for t in tensors]


def test_an_update_left_out_is_left_out_bit_for_bit() -> None:
    plain, guarded = _model_and_optimizer(), _model_and_optimizer()
    _train(*plain, [None, None, None])
    _train(*guarded, [False, False, False])
    assert _bits(*plain) == _bits(*guarded)  # a step the guard lets through is optimizer.step() itself
    # A step left out: weights and moments bit for bit those before it, the optimizer's count advanced.
    one, skipped = _model_and_optimizer(), _model_and_optimizer()
    _train(*one, [None])
    _train(*skipped, [False, True])
    assert _bits(*skipped) == _bits(*one)
    assert [float(s["step"]) for s in skipped[1].state.values()] == [2.0, 2.0]
    # Control: the second step trained differs.
    assert _bits(*guarded) != _bits(*one)
    # A first step left out: the initial weights, and the moments the optimizer created are zeros.
    initial, first = _model_and_optimizer(), _model_and_optimizer()
    _train(*first, [True])
    assert _bits(*first)[:2] == _bits(*initial) and not any(any(bits) for bits in _bits(*first)[2:])


def test_the_loss_log_writes_a_decision_as_a_flag(tmp_path: Path) -> None:
    writer = LossLogWriter(tmp_path / "loss_log.jsonl")
    writer.write({"step": 1, "loss": torch.tensor(2.5), "skipped": torch.tensor(False)})
    writer.write({"step": 2, "loss": torch.tensor(9.5), "skipped": torch.tensor(True)})
    written = writer.flush()
    writer.close()
    assert written == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 9.5, "skipped": True}]
    assert [json.loads(line) for line in (tmp_path / "loss_log.jsonl").read_text().splitlines()] == written
    assert float_bits(read_loss_log(tmp_path)[2]["loss"]) == float_bits(9.5)


@pytest.mark.parametrize(("name", "block"), [
    ("layers.3.attn.qkv.weight", "layers.3"), ("output.weight", "output"), ("_orig_mod.layers.0.ffn.up.weight", "layers.0"),
    ("transformer.double_blocks.1.img.qkv.bias", "transformer.double_blocks.1"),
    ("transformer.img_in.weight", "transformer.img_in"), ("scale", "scale"),
])
def test_the_blocks_replay_reports(name: str, block: str) -> None:
    assert block_of(name) == block
