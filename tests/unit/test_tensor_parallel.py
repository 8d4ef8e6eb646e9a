"""Tensor parallelism without training: how the degrees fill the processes, the one-line refusals the launcher's
preflight gives before any process starts, what a checkpoint of another tensor-parallel degree means, and that
torch's tensor-parallel plan of the Llama computes the model's own outputs and gradients (two gloo processes)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from tests.support.launch import REPO
from tests.support.ranks import end_rank
from torchtitan_rng import resume
from torchtitan_rng.checkpoint import run_record
from torchtitan_rng.checkpoint.dcp_io import inspect_checkpoint
from torchtitan_rng.checkpoint.layout import TRAIN_STATE, rank_key
from torchtitan_rng.config import ConfigError, JobConfig, parse_args
from torchtitan_rng.distributed import data_parallel_degree
from torchtitan_rng.errors import CheckpointError
from torchtitan_rng.parallel import Mode, mode_of
from torchtitan_rng.parallel.layout import FlatLayout
from torchtitan_rng.parallel.numerics import CarriedNumerics
from torchtitan_rng.parallel.pipeline import StagedLayout

CONFIG = str(REPO / "train_configs" / "llama_debug.toml")
TP = "--parallelism.tensor_parallel_degree"


def _config(*overrides: str, config: str = CONFIG) -> JobConfig:
    return parse_args(["--job.config_file", config, *overrides])


def _degrees(shard: int, tp: int, pp: int) -> JobConfig:
    return _config("--parallelism.data_parallel_shard_degree", str(shard), TP, str(tp),
                   "--parallelism.pipeline_parallel_degree", str(pp), "--parallelism.pipeline_parallel_microbatch_size",
                   "4")


@pytest.mark.parametrize(("shard", "tp", "pp", "world_size", "dp"), [
    (-1, 2, 1, 2, 1), (-1, 2, 1, 4, 2), (2, 2, 1, 4, 2), (-1, 2, 2, 4, 1), (-1, 2, 2, 8, 2), (1, 4, 1, 4, 1),
])
def test_shard_tensor_and_pipeline_degrees_multiply_to_the_process_count(shard: int, tp: int, pp: int,
                                                                         world_size: int, dp: int) -> None:
    """torchtitan's meaning: dp_shard x tp x pp = processes, -1 fills; the launcher's check accepts it."""
    config = _degrees(shard, tp, pp)
    assert data_parallel_degree(config.parallelism, world_size) == dp
    mode_of(config.parallelism).check_config(config, world_size)


@pytest.mark.parametrize(("shard", "tp", "pp", "world_size", "fragment"), [
    (2, 2, 1, 2, "data_parallel_shard_degree = 2 x tensor_parallel_degree = 2 is 4 processes, but 2 were started"),
    (-1, 2, 1, 3, "tensor_parallel_degree = 2 does not divide the 3 processes started"),
    (-1, 2, 2, 6, "tensor_parallel_degree x pipeline_parallel_degree = 4 does not divide the 6 processes started"),
    (1, 2, 2, 2, "data_parallel_shard_degree = 1 x tensor_parallel_degree x pipeline_parallel_degree = 4 is 4 "
                 "processes, but 2 were started"),
])
def test_degrees_that_do_not_fill_the_processes_are_refused_in_one_line(shard: int, tp: int, pp: int,
                                                                        world_size: int, fragment: str) -> None:
    config = _degrees(shard, tp, pp)
    for check in (lambda: data_parallel_degree(config.parallelism, world_size),
                  lambda: mode_of(config.parallelism).check_config(config, world_size)):
        with pytest.raises(ConfigError) as refused:
            check()
        assert "\n" not in str(refused.value) and fragment in str(refused.value), str(refused.value)


@pytest.mark.parametrize(("flavor", "tp", "fragment"), [
    ("debug", 3, "llama flavor 'debug' has 4 attention heads (and key/value heads), which 3 ranks do not split "
                 "evenly; choose a degree dividing both its 4 heads and 172 hidden units (1, 2, 4)"),
    ("bench", 3, "llama flavor 'bench' has 2048 MLP hidden units, which 3 ranks do not split evenly"),
])
def test_a_degree_that_does_not_split_the_heads_or_the_hidden_size_is_refused(flavor: str, tp: int,
                                                                              fragment: str) -> None:
    config = _config("--model.flavor", flavor, TP, str(tp))
    with pytest.raises(ConfigError) as refused:
        mode_of(config.parallelism).check_config(config, tp)
    assert "\n" not in str(refused.value) and str(refused.value).startswith(f"config {TP[2:]} = {tp}: "), \
        str(refused.value)
    assert fragment in str(refused.value), str(refused.value)
    mode_of(config.parallelism).check_config(_config("--model.flavor", flavor, TP, "2"), 2)  # control: 2 splits


def test_flux_is_refused_naming_why_and_the_invariant_mode_naming_its_flag() -> None:
    flux = _config(TP, "2", config=str(REPO / "train_configs" / "flux_debug.toml"))
    with pytest.raises(ConfigError) as refused:
        mode_of(flux.parallelism).check_config(flux, 2)
    assert str(refused.value) == (
        "config parallelism.tensor_parallel_degree = 2: model 'flux' does not split over tensor-parallel ranks (its "
        "single-stream blocks project attention's q, k, v and the MLP's input with one linear and take both back "
        "with another, which a column then row split does not follow); run it with "
        "--parallelism.tensor_parallel_degree 1")
    invariant = _config(TP, "2", "--parallelism.world_size_invariant", "--training.global_batch_size", "16",
                        config=str(REPO / "train_configs" / "flux_debug.toml"))
    with pytest.raises(ConfigError, match="^--parallelism.world_size_invariant: model 'flux' computes no layer in "
                                          "tensor chunks"):
        mode_of(invariant.parallelism).check_config(invariant, 2)


def _checkpoint(folder: Path, processes: int, tp: int) -> object:
    """A checkpoint's per-rank train state and run record, as ``processes`` ranks at degree ``tp`` leave them."""
    dcp.save({TRAIN_STATE: {rank_key(rank): torch.tensor(rank) for rank in range(processes)}},
             checkpoint_id=str(folder))
    run_record.write_record(folder, run_record.make_record({TP[2:]: tp}, None))
    return inspect_checkpoint(folder)


def test_another_tensor_parallel_degree_at_a_resume_is_refused_or_reseeded(tmp_path: Path) -> None:
    """tp 2 on 2 processes continued as dp 2 (tp 1): refused, naming both degrees; with reseed it goes on
    (inexact) without stages, never with them; the same degree is an exact resume (the control)."""
    info = _checkpoint(tmp_path, 2, 2)
    flat_tp1, flat_tp2 = Mode(FlatLayout, CarriedNumerics, 1), Mode(FlatLayout, CarriedNumerics, 2)
    assert flat_tp2.check_checkpoint(info, 2, None) is False
    with pytest.raises(CheckpointError) as refused:
        flat_tp1.check_checkpoint(info, 2, "refuse")
    assert str(refused.value) == (
        f"checkpoint {info.path} was saved by parallelism.tensor_parallel_degree = 2 and this run has 1: it cannot "
        "resume exactly (each rank's streams and the split of every sum follow the degree); or pass "
        "on_world_size_change=\"reseed\" to continue anyway (inexact), run with --parallelism.tensor_parallel_degree 2")
    assert flat_tp1.check_checkpoint(info, 2, "reseed") is True
    with pytest.raises(CheckpointError, match="saved by 2 processes at parallelism.tensor_parallel_degree = 2 and this "
                                              "run has 4 at 1"):
        Mode(StagedLayout, CarriedNumerics, 1).check_checkpoint(info, 4, "reseed")


def test_the_record_leaves_the_degree_to_the_checkpoint_rule_without_stages() -> None:
    """The run record compares every other key; the tensor-parallel degree is judged (and named) by the rule
    above, so that a reseeded resume is not refused a second time as a changed key."""
    class Samples:
        def __len__(self) -> int:
            return 64

    saved, resumed = _config(TP, "2"), _config(TP, "1")
    assert run_record.check_resume(Path("ckpt/step-2"), resume.build_record(saved, Samples()),
                                   resume.build_record(resumed, Samples()), [],
                                   compared=resume.compared_by(resumed)) == []


# --- the plan computes the model ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _split_rank(rank: int, port: int, out: str) -> None:
    """One of two ranks: the debug Llama (dropout off) whole and split by its train spec's plan, on the same
    weights and tokens; this rank's logits, loss and full gradients saved for the parent."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from torchtitan_rng.models import get_train_spec

    config = _config("--model.vocab_size", "256")
    spec = get_train_spec(config)
    results = {}
    for split in (False, True):
        torch.manual_seed(0)
        model = spec.build_model(config)
        model.eval()  # no dropout: the same function on both sides
        if split:
            assert spec.tensor_parallel is not None
            spec.tensor_parallel.apply(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss.backward()
        grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                 for name, p in model.named_parameters()}
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])  # as the trainer clips
        results[split] = {"logits": logits.detach(), "loss": loss.detach(), "grads": grads,
                          "norm": norm.full_tensor() if isinstance(norm, DTensor) else norm,
                          "split": sorted(name for name, p in model.named_parameters() if isinstance(p, DTensor))}
    torch.save(results, f"{out}/rank{rank}.pt")
    end_rank()


def test_the_llama_plan_computes_the_models_logits_and_gradients(tmp_path: Path) -> None:
    """Split over two ranks, the model gives (to float32 rounding) the logits, loss, every gradient and the
    gradient norm it gives whole, on both ranks, and every parameter is a DTensor (one mesh for FSDP2 and the norm); control: the whole
    model's parameters are plain tensors, and a model with another weight would not be close."""
    mp.start_processes(_split_rank, args=(_free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in (0, 1):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        whole, split = result[False], result[True]
        assert whole["split"] == [] and len(split["split"]) == len(whole["grads"])
        torch.testing.assert_close(split["logits"], whole["logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(split["loss"], whole["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(split["norm"], whole["norm"], rtol=1e-5, atol=1e-6)  # replicas counted once
        for name, grad in whole["grads"].items():
            torch.testing.assert_close(split["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
        assert not torch.allclose(whole["logits"], whole["logits"] * 1.01, rtol=1e-5, atol=1e-5)
