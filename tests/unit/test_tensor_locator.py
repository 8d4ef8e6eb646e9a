"""The tensor locator's decisions over synthetic fingerprint files, and the recorder's hashes and file in process.

Each kind of divergence is written into a copy of one run's fingerprints; the locator must name that thing and
nothing earlier, and the untouched copy (the control) must name nothing."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils.data import TensorDataset

from tests.support.ranks import end_rank

from torchtitan_rng import ExactResume, build_dataloader
from torchtitan_rng.compare_losses import main as compare_main
from torchtitan_rng.config import parse_args
from torchtitan_rng.diagnosis.locator import (Draws, TensorPrints, locate, module_origins, prints_path,
                                             read_prints)
from torchtitan_rng.diagnosis.tensor_fingerprints import (TensorFingerprints, build_tensor_fingerprints, row_hashes,
                                                           tensor_hash)
from torchtitan_rng.loss_log import LossLogError

PARAMS = ("embed.weight", "layers.0.attn.qkv.weight", "output.weight")
Lines = dict[int, dict[int, dict[str, Any]]]  # step -> rank -> line


def _value(*key: object) -> int:
    return hash(key) % 2**63  # distinct per key; the same in both runs of a test


CONFIG = {"debug.seed": 0, "training.max_norm": 1.0, "job.dump_folder": "A", "debug.tensor_fingerprint": True}


def synthetic(world_size: int = 2, steps: int = 4, micro_batches: int = 2, modules_at: int = 2,
              resumed_at: int | None = None, losses: bool = False, draws: bool = False,
              config: dict[str, Any] | None = None) -> Lines:
    """A run's lines: every rank its own batches; gradients, parameters and (at the saves, every 2 steps) optimizer
    state replicated over ranks. With
    ``losses`` each rank's micro-batch losses, with ``draws`` each module call's draws (attention draws), with
    ``config`` the config rank 0 records where a process starts."""
    lines: Lines = {}
    for step in range(1, steps + 1):
        lines[step] = {}
        for rank in range(world_size):
            line: dict[str, Any] = {"step": step, "world_size": world_size}
            if step == 1 or step == resumed_at:
                line["entering"] = {"param": {name: _value("param", step - 1, name) for name in PARAMS},
                                    "optim": {f"{name}.exp_avg": _value("optim", step - 1, name) for name in PARAMS}
                                    if step > 1 else {}}
                if config is not None and rank == 0:
                    line["config"] = copy.deepcopy(config)
            line["batch"] = [{"input": [_value("input", step, rank, mb, row) for row in range(4)],
                              "labels": [_value("labels", step, rank, mb, row) for row in range(4)]}
                             for mb in range(micro_batches)]
            if losses:
                line["loss"] = [_value("loss", step, rank, mb) for mb in range(micro_batches)]
            if step == modules_at:
                line["modules"] = [[name, [_value("in", step, rank, mb, name)], [_value("out", step, rank, mb, name)]]
                                   + ([_value("rng", step, rank, mb) if name == "layers.0.attn" else None]
                                      if draws else [])
                                   for mb in range(micro_batches) for name in ("embed", "layers.0.attn", "output")]
            line["grad"] = {name: _value("grad", step, name) for name in PARAMS}
            line["param"] = {name: _value("param", step, name) for name in PARAMS}
            if step % 2 == 0:
                line["optim"] = {f"{name}.exp_avg": _value("optim", step, name) for name in PARAMS}
            lines[step][rank] = line
    return lines


def write(folder: Path, lines: Lines) -> Path:
    for rank in sorted({rank for per_rank in lines.values() for rank in per_rank}):
        path = prints_path(folder, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(per_rank[rank]) + "\n" for per_rank in lines.values() if rank in per_rank))
    return folder


def first_difference(tmp_path: Path, a: Lines, b: Lines) -> list[str] | None:
    prints_a, prints_b = read_prints(write(tmp_path / "a", a)), read_prints(write(tmp_path / "b", b))
    assert prints_a is not None and prints_b is not None
    found = locate(prints_a, prints_b)
    return found.lines if found is not None else None


def _changed(change: Callable[[Lines], None], **shape: Any) -> Lines:
    lines = synthetic(**shape)
    change(lines)
    return lines


def _bump_grad_everywhere(lines: Lines, step: int, name: str) -> None:
    for line in lines[step].values():
        line["grad"][name] += 1


# (name, the change, the first sentence the locator must give). Each change also makes everything after it differ,
# as a real divergence does: the locator must still name the first.
def _later_too(lines: Lines, step: int) -> None:
    for later in range(step, max(lines) + 1):
        for line in lines[later].values():
            line["param"]["output.weight"] += 1
            line["grad"]["output.weight"] += 1


def _data(lines: Lines) -> None:
    lines[3][1]["batch"][1]["labels"][2] += 1
    _later_too(lines, 3)


def _kernel(lines: Lines) -> None:
    calls = lines[2][0]["modules"]
    calls[4][2][0] += 1  # micro-batch 1's layers.0.attn output
    calls[5][1][0] += 1  # and so the input of the module after it
    _later_too(lines, 2)


def _between_modules(lines: Lines) -> None:
    lines[2][1]["modules"][1][1][0] += 1  # layers.0.attn's input, with embed's output equal
    _later_too(lines, 2)


def _gradient(lines: Lines) -> None:
    lines[2][1]["grad"]["layers.0.attn.qkv.weight"] += 1
    _later_too(lines, 3)


def _gradient_at_a_plain_step(lines: Lines) -> None:
    lines[3][0]["grad"]["embed.weight"] += 1
    _later_too(lines, 4)


def _optimizer(lines: Lines) -> None:
    for line in lines[4].values():
        line["param"]["embed.weight"] += 1
        line["optim"]["embed.weight.exp_avg"] += 1


def _optimizer_state_only(lines: Lines) -> None:
    lines[4][0]["optim"]["output.weight.exp_avg"] += 1


CASES = {
    "data": (_data, "step 3, rank 1: the batch of micro-batch 1 differs (`labels`, sample(s) 2 of it): the data, "
                    "not the model"),
    "kernel": (_kernel, "step 2, rank 0: `layers.0.attn` output differs, its input equal (a kernel: an operation "
                        "inside it gave other bits; its parameters entered the step equal)"),
    "between": (_between_modules, "step 2, rank 1: `layers.0.attn` input differs, every module call that ended "
                                  "before it gave equal outputs: the difference arose outside any module (code "
                                  "between modules, or the step's input)"),
    "gradient": (_gradient, "step 2, rank 1: gradient of `layers.0.attn.qkv.weight` differs before clipping, the "
                            "batches equal, every module's output equal: the backward pass: a non-deterministic "
                            "kernel (try --debug.deterministic), or the gradients' reduction over the ranks"),
    "gradient_plain_step": (_gradient_at_a_plain_step, "step 3, rank 0: gradient of `embed.weight` differs before "
                                                      "clipping, the batches and the weights entering the step equal: "
                                                      "the step's computation: its random draws (dropout: "
                                                      "--debug.rng_fingerprint tells), a non-deterministic kernel "
                                                      "(compare_losses --locate names the module), or "
                                                      "the gradients' reduction over the ranks"),
    "optimizer": (_optimizer, "step 4, rank 0: gradients equal on every rank, parameter `embed.weight` after the "
                              "update differs (the optimizer: its state or its hyperparameters, e.g. the learning "
                              "rate; the optimizer state equal where last compared, entering step 3)"),
    "optimizer_state": (_optimizer_state_only, "step 4, rank 0: gradients equal on every rank, parameters after the "
                                               "update equal, optimizer state `output.weight.exp_avg` differs (the "
                                               "optimizer's state: what it carries to the next step; the optimizer "
                                               "state equal where last compared, entering step 3)"),
}


@pytest.mark.parametrize("kind", CASES)
def test_each_kind_is_named_first(tmp_path: Path, kind: str) -> None:
    change, expected = CASES[kind]
    assert first_difference(tmp_path, synthetic(), _changed(change)) == [expected]
    # The control: the same runs, nothing changed, nothing named.
    assert first_difference(tmp_path / "control", synthetic(), synthetic()) is None


def test_a_state_perturbed_at_a_resume_is_named_entering_the_step(tmp_path: Path) -> None:
    a = synthetic()
    b = synthetic(resumed_at=3)  # B's process started at step 3, loading what A's step 2 left
    assert first_difference(tmp_path / "control", a, b) is None
    b[3][1]["entering"]["param"]["output.weight"] += 1
    _later_too(b, 3)
    assert first_difference(tmp_path, a, b) == [
        "step 3, rank 1: parameter `output.weight` entering the step differs, before any batch (B resumed here: "
        "what the resume loaded differs: the checkpoint or its loading, not this step's training)"]


def test_an_optimizer_state_loaded_wrong_is_named_where_the_other_run_saved_it(tmp_path: Path) -> None:
    """The optimizer state is hashed where a process starts and at saves only: a resume's loaded state is compared
    with the other run's state where that run saved at the same step, and otherwise the verdict says it was not."""
    a, b = synthetic(), synthetic(resumed_at=3)  # A saved after step 2 (every 2 steps), B resumed from there
    for line in b[3].values():
        line["entering"]["optim"]["embed.weight.exp_avg"] += 1
        line["param"]["embed.weight"] += 1  # its first update with the wrong moments
    _later_too(b, 4)
    assert first_difference(tmp_path / "saved", a, b) == [
        "step 3, rank 0: optimizer state `embed.weight.exp_avg` entering the step differs, before any batch (B "
        "resumed here: what the resume loaded differs: the checkpoint or its loading, not this step's training)"]
    for line in a[2].values():  # A saved no checkpoint at step 2: nothing to compare B's loaded state with
        del line["optim"]
    assert first_difference(tmp_path / "unsaved", a, b) == [
        "step 3, rank 0: gradients equal on every rank, parameter `embed.weight` after the update differs (the "
        "optimizer: its state or its hyperparameters, e.g. the learning rate; the optimizer state B's resume loaded "
        "not compared: A hashed none after step 2 (it is hashed where a process starts and at saves))"]


def _over(world_size: int, lines: Lines, sharded: tuple[str, ...]) -> Lines:
    """``lines`` (one process, micro-batches 0..N-1) as trained by ``world_size`` ranks of N/world_size micro-batches
    each: batches dealt out in order, the named tensors sharded (each rank's hash a part; the parts add up)."""
    out: Lines = {}
    for step, per_rank in lines.items():
        whole = per_rank[0]
        share = len(whole["batch"]) // world_size
        out[step] = {}
        for rank in range(world_size):
            line = copy.deepcopy(whole)
            line["world_size"] = world_size
            line["batch"] = copy.deepcopy(whole["batch"][rank * share:(rank + 1) * share][::-1])  # another order
            line.pop("modules", None)
            for prints in (line["grad"], line["param"], line.get("optim", {}), *line.get("entering", {}).values()):
                for name, value in prints.items():
                    if name.split(".exp_avg")[0] in sharded:
                        part = value // world_size
                        prints[name] = part if rank else value - part * (world_size - 1)
            if step == 1:
                line["sharded"] = [name for name in [*line["grad"], *lines[2][0]["optim"]]
                                   if name.split(".exp_avg")[0] in sharded]
            out[step][rank] = line
    return out


def test_another_process_count_compares_whole_steps(tmp_path: Path) -> None:
    one = synthetic(world_size=1)
    two = _over(2, one, sharded=("embed.weight", "output.weight"))
    # The control: the same samples and the same whole tensors over two ranks: nothing named.
    assert first_difference(tmp_path / "control", one, two) is None
    for line in two[2].values():
        line["grad"]["output.weight"] += 1  # each rank's part moves: the whole moves
    assert first_difference(tmp_path, one, two) == [
        "step 2: gradient of `output.weight` differs before clipping, the same samples: summed over 1 against 2 "
        "processes: another reduction order (and each rank's own random draws), which is expected outside the "
        "world-size-invariant mode"]
    other = _over(2, one, sharded=())
    other[1][1]["batch"][0]["input"][0] += 1
    assert first_difference(tmp_path / "samples", one, other) == [
        "step 1: the samples of the step differ (as a set over every rank and micro-batch, 1 against 2 processes): "
        "the data, not the model"]


def _one_micro_batch(lines: Lines) -> Lines:
    """``lines`` with each rank's micro-batches of a step taken as one (the same samples in the same order), as a
    run with a larger training.local_batch_size splits the step: its module calls and losses are other ones."""
    out = copy.deepcopy(lines)
    for step, per_rank in out.items():
        for rank, line in per_rank.items():
            line["batch"] = [{key: [row for batch in line["batch"] for row in batch[key]] for key in line["batch"][0]}]
            line.pop("modules", None)
            line["loss"] = [_value("loss of one micro-batch", step, rank)]
    return out


def test_another_split_of_the_step_is_named_as_the_split(tmp_path: Path) -> None:
    two = synthetic(world_size=1, losses=True)  # 2 x 4 samples a step
    one = _one_micro_batch(two)  # 1 x 8: the same samples
    # The control: the same samples, the same tensors: nothing named (not the batches, modules or losses either).
    assert first_difference(tmp_path / "control", two, one) is None
    one[1][0]["grad"]["embed.weight"] += 1
    _later_too(one, 1)
    assert first_difference(tmp_path, two, one) == [
        "step 1, rank 0: gradient of `embed.weight` differs before clipping, the same samples, split as A 2 × 4 "
        "against B 1 × 8 micro-batches × samples: another split of the step: its sums run in another order, and its "
        "random draws fall per micro-batch otherwise"]
    other = _one_micro_batch(two)
    other[2][0]["batch"][0]["labels"][5] += 1
    assert first_difference(tmp_path / "samples", two, other) == [
        "step 2, rank 0: the samples of the step differ (as a set over its micro-batches, A 2 × 4 against B 1 × 8 "
        "micro-batches × samples): the data, not the model"]


def _attention_call(lines: Lines) -> list[Any]:
    """Micro-batch 0's `layers.0.attn` call on rank 0 at step 2 (the module step), its output and the input of the
    call after it changed, as its other output changes them."""
    calls = lines[2][0]["modules"]
    calls[1][2][0] += 1
    calls[2][1][0] += 1
    _later_too(lines, 2)
    return calls[1]


def test_a_module_whose_random_draws_differ_is_named_as_draws(tmp_path: Path) -> None:
    a = synthetic(draws=True)
    other_state = synthetic(draws=True)
    _attention_call(other_state)[3] += 1  # it drew from another state of the streams
    assert first_difference(tmp_path / "state", a, other_state) == [
        "step 2, rank 0: `layers.0.attn` output differs, its input equal: its random draws differ: the random "
        "streams entering it differ (--debug.rng_fingerprint names which)"]
    switched_off = synthetic(draws=True)
    _attention_call(switched_off)[3] = None  # it drew nothing: dropout switched off in B
    assert first_difference(tmp_path / "off", a, switched_off) == [
        "step 2, rank 0: `layers.0.attn` output differs, its input equal: its random draws differ: it drew random "
        "numbers in A and none in B (dropout switched off in B?)"]
    # The control: the same draws from the same state, and the output differs all the same: a kernel.
    same_draws = synthetic(draws=True)
    _attention_call(same_draws)
    assert first_difference(tmp_path / "kernel", a, same_draws) == [CASES["kernel"][1]]


def test_a_stream_named_by_the_stream_diagnosis_makes_the_draws_the_cause(tmp_path: Path) -> None:
    a, b = synthetic(), synthetic()  # module calls without their draws recorded
    _attention_call(b)
    prints_a, prints_b = read_prints(write(tmp_path / "a", a)), read_prints(write(tmp_path / "b", b))
    assert prints_a is not None and prints_b is not None
    found = locate(prints_a, prints_b, draws=Draws(2, {0: ["torch_cpu"]}))
    assert found is not None and found.lines == [
        "step 2, rank 0: `layers.0.attn` output differs, its input equal: its random draws differ: stream torch_cpu "
        "on rank 0 differs entering step 2, as named above"]
    # The control: a stream of another rank named: rank 0's difference stays a kernel.
    found = locate(prints_a, prints_b, draws=Draws(2, {1: ["torch_cpu"]}))
    assert found is not None and found.lines == [CASES["kernel"][1]]


def _rank_1_draws_once_more(lines: Lines) -> None:
    """Rank 1's forward of step 3 differs (an extra draw on rank 1); the gradients, reduced over the ranks, differ
    on every rank."""
    if "loss" in lines[3][1]:
        lines[3][1]["loss"][0] += 1
    for line in lines[3].values():
        line["grad"]["embed.weight"] += 1
    _later_too(lines, 3)


def test_a_divergence_that_starts_on_rank_1_is_named_on_rank_1(tmp_path: Path) -> None:
    a, b = synthetic(losses=True), _changed(_rank_1_draws_once_more, losses=True)
    assert first_difference(tmp_path, a, b) == [
        "step 3, rank 1: its loss of micro-batch 0 differs, the batches and the weights entering the step equal, the "
        "losses of rank 0 equal: the forward pass on this rank, before any reduction over the ranks: its random draws "
        "(dropout: --debug.rng_fingerprint tells) or a non-deterministic kernel (compare_losses --locate names the "
        "module)"]
    # Without losses recorded, the stream diagnosis' rank leads among the ranks whose gradients differ.
    a, b = synthetic(), _changed(_rank_1_draws_once_more)
    prints_a, prints_b = read_prints(write(tmp_path / "a", a)), read_prints(write(tmp_path / "b", b))
    assert prints_a is not None and prints_b is not None
    found = locate(prints_a, prints_b, draws=Draws(3, {1: ["torch_cpu"]}))
    assert found is not None and found.lines == [
        "step 3, rank 1: gradient of `embed.weight` differs before clipping, the batches and the weights entering "
        "the step equal: its random draws differ: stream torch_cpu on rank 1 differs entering step 3, as named above"]
    found = locate(prints_a, prints_b)  # the control: nothing says where it began: the first rank
    assert found is not None and found.lines[0].startswith("step 3, rank 0: gradient of `embed.weight`")


def _initial_weights_differ(lines: Lines) -> None:
    for line in lines[1].values():
        line["entering"]["param"]["embed.weight"] += 1
    _later_too(lines, 1)


def test_fresh_runs_are_named_by_their_config_difference(tmp_path: Path) -> None:
    a = synthetic(config=CONFIG)
    same = synthetic(config={**CONFIG, "job.dump_folder": "B"})  # a key that cannot change the losses
    assert first_difference(tmp_path / "control", a, same) is None
    seeded = _changed(_initial_weights_differ, config={**CONFIG, "debug.seed": 1, "job.dump_folder": "B"})
    assert first_difference(tmp_path / "seed", a, seeded) == [
        "step 1, rank 0: parameter `embed.weight` entering the step differs, before any batch (neither run resumed "
        "here: the initial weights differ; the configs differ in debug.seed 0 vs 1)"]
    unrecorded = _changed(_initial_weights_differ)
    assert first_difference(tmp_path / "unrecorded", synthetic(), unrecorded) == [
        "step 1, rank 0: parameter `embed.weight` entering the step differs, before any batch (neither run resumed "
        "here: the initial weights differ: their seed (debug.seed), the model's initialization code, or a checkpoint "
        "loaded as the initial weights)"]


def test_a_key_changed_at_a_resume_is_named_from_the_two_records(tmp_path: Path) -> None:
    a = synthetic(config=CONFIG)
    b = synthetic(config=CONFIG, resumed_at=3)
    assert first_difference(tmp_path / "control", a, b) is None
    b[3][0]["config"]["training.max_norm"] = 0.5  # allowed by checkpoint.allow_config_change at the resume
    for line in b[3].values():
        line["param"]["embed.weight"] += 1  # other clipping: the same gradients, another update
    _later_too(b, 4)
    assert first_difference(tmp_path, a, b) == [
        "step 3, rank 0: gradients equal on every rank, parameter `embed.weight` after the update differs (the "
        "optimizer: its state or its hyperparameters; the configs differ in training.max_norm 1.0 → 0.5 (B's resume "
        "entering step 3); the optimizer state equal where last compared, entering this step)"]


def _rng_log(folder: Path, losses: list[float], run: str, ranks: int = 2) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "loss_log.jsonl").write_text("".join(
        json.dumps({"step": step, "loss": loss, "rng_fingerprint": [{"torch_cpu": f"{run}{step}{rank}"}
                                                                    for rank in range(ranks)]}) + "\n"
        for step, loss in enumerate(losses, start=1)))


def test_compare_losses_names_fresh_runs_by_their_configs_not_a_restore(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    a = write(tmp_path / "a", synthetic(config=CONFIG))
    b = write(tmp_path / "b", _changed(_initial_weights_differ, config={**CONFIG, "debug.seed": 1}))
    _rng_log(a, [3.0, 2.5, 2.0, 1.5], "a")
    _rng_log(b, [3.25, 2.5, 2.0, 1.5], "b")
    assert compare_main([str(a), str(b)]) == 1
    assert capsys.readouterr().out.splitlines()[1:] == [
        "random streams first differ entering step 1:",
        "  stream torch_cpu on rank 0 (A a10, B b10)",
        "  stream torch_cpu on rank 1 (A a11, B b11)",
        "  hint: neither run had resumed entering step 1, so nothing was restored: they were seeded or launched "
        "differently; their configs differ: debug.seed 0 vs 1",
        "the first tensor that differs: step 1, rank 0: parameter `embed.weight` entering the step differs, before "
        "any batch (neither run resumed here: the initial weights differ; the configs differ in debug.seed 0 vs 1)"]
    # Without tensor fingerprints nothing records the configs: the hint names what to look at, and the process
    # count, which the stream fingerprints themselves show.
    plain_a, plain_b = tmp_path / "plain_a", tmp_path / "plain_b"
    _rng_log(plain_a, [3.0, 2.5], "a")
    _rng_log(plain_b, [3.25, 2.5], "b", ranks=1)
    assert compare_main([str(plain_a), str(plain_b)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == (
        "  hint: neither run had resumed entering step 1, so nothing was restored: they were seeded or launched "
        "differently; their configs differ: the process count 2 vs 1")


def test_a_step_written_twice_counts_by_its_later_line(tmp_path: Path) -> None:
    a = write(tmp_path / "a", synthetic(world_size=1))
    b = write(tmp_path / "b", synthetic(world_size=1))
    path = prints_path(b, 0)
    lines = path.read_text().splitlines()
    bad = json.loads(lines[2])
    bad["grad"]["embed.weight"] += 1
    # A crashed attempt wrote a bad step 3; its resume wrote the step again.
    path.write_text("\n".join([*lines[:2], json.dumps(bad), *lines[2:]]) + "\n")
    assert locate(read_prints(a), read_prints(b)) is None  # type: ignore[arg-type]
    path.write_text("\n".join([*lines, json.dumps(bad)]) + "\n")  # control: the bad line last
    assert locate(read_prints(a), read_prints(b)).step == 3  # type: ignore[arg-type, union-attr]


# The kinds inside a step's computation (the batches and the weights entering it equal): what --locate replays.
IN_COMPUTATION = {"kernel", "between", "gradient", "gradient_plain_step"}


@pytest.mark.parametrize("kind", CASES)
def test_a_difference_inside_the_computation_is_marked_for_a_replay(tmp_path: Path, kind: str) -> None:
    prints_a, prints_b = (read_prints(write(tmp_path / "a", synthetic())),
                          read_prints(write(tmp_path / "b", _changed(CASES[kind][0]))))
    assert prints_a is not None and prints_b is not None
    found = locate(prints_a, prints_b)
    assert found is not None and found.in_computation == (kind in IN_COMPUTATION)


def test_module_origins_name_per_rank_the_first_call_with_equal_inputs(tmp_path: Path) -> None:
    def noisy(lines: Lines) -> None:
        _kernel(lines)  # rank 0: micro-batch 1's layers.0.attn (call 5), the call after it from its input on
        lines[2][1]["modules"][1][2][0] += 1  # rank 1: micro-batch 0's layers.0.attn (call 2)
        lines[2][1]["modules"][2][1][0] += 1
        lines[2][1]["modules"][4][2][0] += 1  # and later ones, which must not be named
        lines[2][1]["modules"][5][1][0] += 1
        lines[2][1]["modules"][4][3:] = [1]  # a draw in B only, after the first difference

    prints_a, prints_b = read_prints(write(tmp_path / "a", synthetic())), read_prints(write(tmp_path / "b",
                                                                                        _changed(noisy)))
    assert prints_a is not None and prints_b is not None
    assert module_origins(prints_a, prints_b, 2) == [
        "step 2, rank 0: module layers.0.attn (call 5 of the step): inputs equal, output differs",
        "step 2, rank 1: module layers.0.attn (call 2 of the step): inputs equal, output differs"]
    # A call whose input differs first, a call that drew otherwise, and the control: nothing differs.
    between = read_prints(write(tmp_path / "between", _changed(_between_modules)))
    assert between is not None and module_origins(prints_a, between, 2) == [
        "step 2, rank 1: module layers.0.attn (call 2 of the step): input differs, every call that ended before it "
        "equal: the difference arose outside any module (code between modules)"]
    drew = synthetic(draws=True)
    drew[2][0]["modules"][1][2][0] += 1
    drew[2][0]["modules"][1][3] += 1
    drawn = read_prints(write(tmp_path / "drew", drew))
    assert drawn is not None and module_origins(read_prints(write(tmp_path / "d", synthetic(draws=True))), drawn,
                                                2) == ["step 2, rank 0: module layers.0.attn (call 2 of the step): "
                                                       "inputs equal, output differs; its random draws differ"]
    assert module_origins(prints_a, prints_a, 2) == []


def _lines(out: str) -> list[str]:
    return out.splitlines()


def test_compare_losses_locate_replays_only_a_computation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--locate keeps the verdict and its exit code where there is nothing to replay: a data difference, equal
    fingerprints (the control), runs without fingerprints; a computation in runs without checkpoints is one line,
    exit 2 (the replays, with checkpoints: tests/unit/test_code_from_checkpoints.py, tests/e2e)."""
    a, data = write(tmp_path / "a", synthetic()), write(tmp_path / "data", _changed(_data))
    _loss_log(a, [3.0, 2.5, 2.0, 1.5])
    _loss_log(data, [3.0, 2.5, 2.25, 1.5])
    assert compare_main([str(a), str(data), "--locate"]) == 1
    out = _lines(capsys.readouterr().out)
    assert out[-2].endswith(CASES["data"][1]) and out[-1] == (
        "--locate: nothing to replay: the first difference (step 3, above) is not in a step's forward or backward "
        "from equal batches and weights, split alike over the same ranks")
    assert compare_main([str(a), str(a), "--locate"]) == 0
    assert _lines(capsys.readouterr().out) == ["identical: 4 steps (1..4) with bitwise-equal losses",
                                               "--locate: nothing to replay: every tensor fingerprint equal"]
    _loss_log(tmp_path / "plain", [3.0, 2.5, 2.0, 1.5])
    assert compare_main([str(tmp_path / "plain"), str(tmp_path / "plain"), "--locate"]) == 0
    assert _lines(capsys.readouterr().out)[-1] == ("--locate: nothing to replay: it needs both runs' tensor "
                                                   "fingerprints (--debug.tensor_fingerprint) to find a step whose "
                                                   "computation differs")
    gradient = write(tmp_path / "gradient", _changed(_gradient))
    _loss_log(gradient, [3.0, 2.5, 2.25, 1.5])
    assert compare_main([str(a), str(gradient), "--locate"]) == 2
    captured = capsys.readouterr()
    assert _lines(captured.out)[-1].endswith(CASES["gradient"][1])  # nothing said of a replay: none ran
    assert captured.err == (f"error: --locate cannot rebuild A ({a}): its dump folder holds no complete checkpoint, "
                            "whose run.json records the config to replay from; train it with --checkpoint.enable, "
                            "its checkpoints in the dump folder (--locate looks nowhere else)\n")


def test_reports_for_runs_without_fingerprints(tmp_path: Path) -> None:
    with_prints = write(tmp_path / "a", synthetic())
    (tmp_path / "plain").mkdir()
    assert TensorPrints(tmp_path / "plain", tmp_path / "plain").report() == ("absent", [])
    state, lines = TensorPrints(with_prints, tmp_path / "plain").report()
    assert state == "absent" and lines[0].startswith("tensor fingerprints only in A: run both with "
                                                     "--debug.tensor_fingerprint")
    bad = prints_path(tmp_path / "bad", 0)
    bad.parent.mkdir(parents=True)
    bad.write_text("{\"loss\": 1}\n")
    with pytest.raises(LossLogError, match=r"rank0.jsonl:1: not a tensor-fingerprint line"):
        read_prints(tmp_path / "bad")


def _loss_log(folder: Path, losses: list[float]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "loss_log.jsonl").write_text("".join(json.dumps({"step": step, "loss": loss}) + "\n"
                                                   for step, loss in enumerate(losses, start=1)))


def test_compare_losses_names_the_tensor_and_keeps_its_exit_codes(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    a, b = write(tmp_path / "a", synthetic()), write(tmp_path / "b", _changed(_gradient))
    _loss_log(a, [3.0, 2.5, 2.0, 1.5])
    _loss_log(b, [3.0, 2.5, 2.0, 1.5])
    # Equal losses, a differing gradient: a note, and still exit 0 (the losses are what compare_losses compares).
    assert compare_main([str(a), str(b)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "note: the losses are equal, but the first tensor that differs: " + CASES["gradient"][1]
    _loss_log(b, [3.0, 2.5, 2.25, 1.5])
    assert compare_main([str(a), str(b / "loss_log.jsonl")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("first differing step 3") and out[-1].endswith(CASES["gradient"][1])
    assert compare_main([str(a), str(a)]) == 0  # the control: nothing differs, nothing beyond the one line
    assert capsys.readouterr().out.splitlines() == ["identical: 4 steps (1..4) with bitwise-equal losses"]


def _weights(shape: tuple[int, ...]) -> list[int]:
    """Each place's weight in a hash, measured: the hash of a tensor whose bits are 1 there and 0 elsewhere."""
    weights = []
    for index in range(math.prod(shape)):
        one = torch.zeros(math.prod(shape), dtype=torch.int32)
        one[index] = 1
        weights.append(int(tensor_hash(one.view(torch.float32).reshape(shape))) % 2**32)
    return weights


def test_hashes_see_what_a_xor_misses() -> None:
    ones = torch.ones(8)
    scaled = ones * 1.5
    # torch.hash_tensor XORs: an even count of equal elements cancels, before and after a uniform change.
    assert torch.hash_tensor(ones) == torch.hash_tensor(scaled) == 0
    assert tensor_hash(scaled) != tensor_hash(ones)
    # An exact weighted sum, modulo 2**32: each element's bits times its place's weight, every weight odd and
    # every place's its own.
    values = torch.randn(5, 4)
    weights = _weights((5, 4))
    assert all(weight % 2 == 1 for weight in weights) and len(set(weights)) == len(weights)
    bits = values.view(torch.int32).flatten().tolist()
    assert int(tensor_hash(values)) % 2**32 == sum(b * w for b, w in zip(bits, weights)) % 2**32
    nudged = ones.clone()
    nudged[3] = torch.nextafter(nudged[3], torch.tensor(2.0))
    # One ulp of one element moves the hash by that place's (odd, so never vanishing) weight.
    assert (int(tensor_hash(nudged)) - int(tensor_hash(ones))) % 2**32 == _weights((8,))[3]
    assert int(tensor_hash(values.t())) == int(tensor_hash(values.t().contiguous()))  # places, not memory


def test_hashes_see_a_permutation_inside_a_tensor() -> None:
    square = torch.randn(6, 6)
    moved = {
        "transposed": square.t().contiguous(),
        "rows permuted": square[torch.tensor([1, 0, 2, 3, 5, 4])],
        "two elements of a row swapped": square[:, torch.tensor([1, 0, 2, 3, 4, 5])],
        "bfloat16 transposed": square.bfloat16().t().contiguous(),
    }
    for name, tensor in moved.items():
        original = square.bfloat16() if tensor.dtype == torch.bfloat16 else square
        # The same elements (the plain sum of their bits cannot tell), in other places: the hash tells.
        assert int(_plain_sum(tensor)) == int(_plain_sum(original)), name
        assert int(tensor_hash(tensor)) != int(tensor_hash(original)), name
    assert int(tensor_hash(square.clone())) == int(tensor_hash(square))  # the control: a copy hashes the same
    # Tensors of more elements than the hash's period (one reduction of a view): the same.
    large = torch.randn(300, 300)
    embedding = torch.randn(70000, 4)
    for tensor, moved_tensor in ((large, large.t().contiguous()), (embedding, embedding.roll(1, dims=0))):
        assert int(_plain_sum(moved_tensor)) == int(_plain_sum(tensor))
        assert int(tensor_hash(moved_tensor)) != int(tensor_hash(tensor))
        assert int(tensor_hash(tensor.clone())) == int(tensor_hash(tensor))


def _plain_sum(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32).sum(dtype=torch.int32)


_SHARDS = 2


# A small tensor, and one of more elements than the hash's period (its shards start inside a period).
_SHAPES = ((5, 3), (40001, 5))


def _whole(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _hash_shards(rank: int, folder: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder / 'store'}", rank=rank, world_size=_SHARDS)
    mesh = init_device_mesh("cpu", (_SHARDS,))
    hashes = {}
    for shape in _SHAPES:
        whole = _whole(shape)
        for dim in (0, 1):
            hashes[f"{shape} Shard({dim})"] = int(tensor_hash(distribute_tensor(whole, mesh, [Shard(dim)])))
        # The control: the local shard hashed as a tensor of its own (its places counted from 0, not in the whole).
        hashes[f"{shape} local"] = int(tensor_hash(distribute_tensor(whole, mesh, [Shard(0)]).to_local()))
    (folder / f"rank{rank}.json").write_text(json.dumps(hashes))
    end_rank()


def test_shards_hashes_add_up_to_the_whole_tensors(tmp_path: Path) -> None:
    """FSDP2 shards a tensor unevenly over the ranks (5 rows: 3 and 2): each rank hashes its shard with the places
    its elements hold in the whole, and the shards' hashes add up to the whole tensor's, along either dimension."""
    mp.spawn(_hash_shards, args=(tmp_path,), nprocs=_SHARDS, join=True)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(_SHARDS)]
    for shape in _SHAPES:
        whole = int(tensor_hash(_whole(shape))) % 2**32
        for placement in ("Shard(0)", "Shard(1)"):
            assert sum(hashes[f"{shape} {placement}"] for hashes in ranks) % 2**32 == whole, (shape, placement)
        assert sum(hashes[f"{shape} local"] for hashes in ranks) % 2**32 != whole, shape


def test_row_hashes_are_per_sample_and_see_positions() -> None:
    tokens = torch.arange(64).reshape(4, 16)
    hashes = row_hashes(tokens)
    assert hashes.shape == (4,) and hashes.dtype == torch.int64
    assert row_hashes(tokens.flip(0)).tolist() == hashes.flip(0).tolist()  # a sample keeps its hash
    swapped = tokens.clone()
    swapped[2, [0, 1]] = swapped[2, [1, 0]]
    # Two tokens swapped: that sample's hash moves, and only it (a plain sum of the row would not see it).
    assert (row_hashes(swapped) != hashes).tolist() == [False, False, True, False]
    assert int(tensor_hash(swapped)) != int(tensor_hash(tokens))
    assert row_hashes(torch.randn(2, 3, dtype=torch.bfloat16)).shape == (2,)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.out = nn.Linear(4, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(tokens))


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["input"]).flatten(0, 1), batch["labels"].flatten())


def _train(dump: Path, steps: int, *flags: str) -> TensorFingerprints | None:
    torch.manual_seed(0)
    model = _Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = parse_args(["--job.dump_folder", str(dump), *flags])
    prints = build_tensor_fingerprints(config.debug, model, optimizer, rank=0, world_size=1, dump_folder=dump,
                                       config={"debug.seed": config.debug.seed})
    if prints is None:
        return None
    data = iter([{"input": torch.randint(0, 16, (2, 5)), "labels": torch.randint(0, 16, (2, 5))}
                 for _ in range(steps)])
    batches = prints.batches(data)
    for step in range(1, steps + 1):
        prints.step_begin(step)
        batch = next(batches)
        loss = prints.losses(_loss)(model, batch)
        loss.backward()
        prints.gradients()
        optimizer.step()
        optimizer.zero_grad()
        prints.updated(flush=step == steps)
        if step in (2, steps):  # saves: the one at the last step comes after its line was written
            prints.saving(step)
    prints.close()
    assert not model.embed._forward_hooks  # the module hooks came off after their step
    return prints


def test_the_recorder_writes_exact_ints_and_hooks_one_step(tmp_path: Path) -> None:
    assert _train(tmp_path / "off", 2) is None  # off: no recorder at all, so the trainer does nothing per step
    assert not (tmp_path / "off").exists()
    _train(tmp_path / "on", 3, "--debug.tensor_fingerprint", "--debug.fingerprint_modules_at_step", "2")
    lines = [json.loads(line) for line in prints_path(tmp_path / "on", 0).read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 3]  # step 3 again, whole, with what its save added
    assert set(lines[0]) == {"step", "world_size", "entering", "config", "batch", "loss", "grad", "param"}
    assert "optim" not in lines[2] and lines[3] == {**lines[2], "optim": lines[3]["optim"]}
    assert lines[0]["config"] == {"debug.seed": 0} and "config" not in lines[1]  # where the process started
    assert all(len(line["loss"]) == 1 and isinstance(line["loss"][0], int) for line in lines)
    # Each call: its name, input and output hashes, and null where it drew no random number.
    assert [call[0] for call in lines[1]["modules"]] == ["embed", "out"] and "modules" not in lines[2]
    assert [call[3] for call in lines[1]["modules"]] == [None, None]
    assert set(lines[1]["optim"]) == {f"{name}.{key}" for name in ("embed.weight", "out.weight", "out.bias")
                                      for key in ("step", "exp_avg", "exp_avg_sq")}
    torch.manual_seed(0)
    expected = _Tiny()
    assert lines[0]["entering"]["param"]["embed.weight"] == int(tensor_hash(expected.embed.weight))
    # With debug.fingerprint_optimizer_every_step, every step's line holds the optimizer state.
    _train(tmp_path / "every", 3, "--debug.tensor_fingerprint", "--debug.fingerprint_optimizer_every_step")
    every = [json.loads(line) for line in prints_path(tmp_path / "every", 0).read_text().splitlines()]
    assert [line["step"] for line in every] == [1, 2, 3] and all("optim" in line for line in every)
    assert every[1]["optim"] == lines[1]["optim"]
    # A second identical run: every fingerprint equal (the control); then the file's steps are comparable.
    _train(tmp_path / "again", 3, "--debug.tensor_fingerprint", "--debug.fingerprint_modules_at_step", "2")
    assert TensorPrints(tmp_path / "on", tmp_path / "again").report()[0] == "equal"


class _Square(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.mix = nn.Linear(4, 4, bias=False)
        self.out = nn.Linear(4, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mix(self.embed(tokens))))


_DATA = torch.Generator().manual_seed(1)
_BATCHES = [{key: torch.randint(0, 16, (2, 5), generator=_DATA) for key in ("input", "labels")} for _ in range(4)]


def _steps(dump: Path, first: int, last: int, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Steps ``first..last`` of one process recording fingerprints (from ``state`` where given, as a resume
    loads it); returns the state it leaves."""
    torch.manual_seed(0)
    model = _Square()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    prints = TensorFingerprints(parse_args(["--debug.tensor_fingerprint"]).debug, model, optimizer, rank=0,
                                world_size=1, dump_folder=dump)
    batches = prints.batches(iter(_BATCHES[first - 1:last]))
    for step in range(first, last + 1):
        prints.step_begin(step)
        batch = next(batches)
        loss = nn.functional.cross_entropy(model(batch["input"]).flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        prints.gradients()
        optimizer.step()
        optimizer.zero_grad()
        prints.updated(flush=False)
        if step % 2 == 0:  # a checkpoint every 2 steps: the optimizer state is hashed there
            prints.saving(step)
    prints.close()
    return copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})


def test_a_weight_loaded_transposed_or_with_rows_permuted_is_named_as_the_load(tmp_path: Path) -> None:
    """A loader that puts a square weight in transposed, or a weight's rows in another order (a converter's bug):
    the same elements, in other places. Named entering the resumed step, as what the resume loaded."""
    _steps(tmp_path / "A", 1, 4)
    stopped = _steps(tmp_path / "exact", 1, 2)
    _steps(tmp_path / "exact", 3, 4, stopped)
    assert TensorPrints(tmp_path / "A", tmp_path / "exact").report()[0] == "equal"  # the control: an exact resume
    faults = {"mix.weight": lambda weight: weight.t().contiguous(),  # transposed
              "out.weight": lambda weight: weight.roll(1, dims=0)}  # rows permuted
    for name, fault in faults.items():
        loaded = copy.deepcopy(stopped)
        loaded["model"][name] = fault(loaded["model"][name])
        assert int(_plain_sum(loaded["model"][name])) == int(_plain_sum(stopped["model"][name]))
        _steps(tmp_path / name, 1, 2)
        _steps(tmp_path / name, 3, 4, loaded)
        assert TensorPrints(tmp_path / "A", tmp_path / name).report() == ("found", [
            f"the first tensor that differs: step 3, rank 0: parameter `{name}` entering the step differs, before "
            "any batch (B resumed here: what the resume loaded differs: the checkpoint or its loading, not this "
            "step's training)"]), name


def test_runs_recorded_outside_the_trainer_are_told_their_own_option_and_not_replayed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Runs of ExactResume, the HF Trainer, Lightning or the torchtitan plug-in (their config has no
    ``job.dump_folder``): the hint names their fingerprint_modules_at_step, and --locate refuses in one line, exit 2,
    where it would replay. Control: the trainer's runs are told compare_losses --locate."""
    elsewhere = {"dump_folder": "./outputs", "training.max_norm": 1.0}
    a = write(tmp_path / "a", synthetic(config=elsewhere))
    b = write(tmp_path / "b", _changed(_gradient_at_a_plain_step, config=elsewhere))
    for run in (a, b):
        _loss_log(run, [3.0, 2.5, 2.0, 1.5] if run == a else [3.0, 2.5, 2.0, 1.25])
    assert compare_main([str(a), str(b), "--locate"]) == 2
    captured = capsys.readouterr()
    assert "(rerun both with fingerprint_modules_at_step 3: it names the module)" in captured.out, captured.out
    assert "--locate" not in captured.out
    assert captured.err == ("error: --locate replays steps of this project's trainer, and these runs were trained "
                            "elsewhere (ExactResume, the HF Trainer or Lightning integration, the torchtitan plug-in): "
                            "rerun both with fingerprint_modules_at_step 3 and compare them again (each module call "
                            "is then compared)\n")
    trainer = {"job.dump_folder": "./outputs", "training.max_norm": 1.0}
    assert first_difference(tmp_path / "own", synthetic(config=trainer),
                            _changed(_gradient_at_a_plain_step, config=trainer))[0].endswith(
        "(compare_losses --locate names the module), or the gradients' reduction over the ranks")


def _own_loop_lines(folder: Path, every_step: bool) -> dict[int, dict[str, Any]]:
    """Four steps of an ExactResume loop saving every 2 steps, and once more by its own ``save`` after step 3 (as
    a signal's save): each step's line as the locator reads it (a step written twice counts by its later line)."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = build_dataloader(TensorDataset(torch.arange(32.0).view(16, 2)), batch_size=2, seed=0)
    with ExactResume(folder / "checkpoint", model=model, optimizer=optimizer, dataloader=loader, interval=2, seed=0,
                     tensor_fingerprint=True, fingerprint_optimizer_every_step=every_step) as exact:
        exact.load()
        batches = iter(loader)
        exact.restore_rng()
        for step in range(1, 5):
            (inputs,) = next(batches)
            loss = model(inputs).sum()
            optimizer.zero_grad()
            loss.backward()
            exact.fingerprint((inputs,), loss)
            optimizer.step()
            exact.maybe_save(step, last_step=4)
            if step == 3:
                exact.save(step)
    lines = {}
    for text in prints_path(folder, 0).read_text().splitlines():
        line = json.loads(text)
        lines[line["step"]] = line
    return lines


def test_the_own_loop_hashes_the_optimizer_state_at_its_saves_or_every_step(tmp_path: Path) -> None:
    saves = _own_loop_lines(tmp_path / "saves", every_step=False)
    assert [step for step, line in saves.items() if "optim" in line] == [2, 3, 4]  # the interval's and its own save
    every = _own_loop_lines(tmp_path / "every", every_step=True)
    assert [step for step, line in every.items() if "optim" in line] == [1, 2, 3, 4]
    assert all(every[step]["optim"] == saves[step]["optim"] for step in (2, 3, 4))  # the same state, hashed alike
