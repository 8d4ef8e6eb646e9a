"""Tensor-split layers computed chunk by chunk (``parallel/invariant/chunks.py``, ``models/llama/chunked.py``):
the same bits, forward and backward, whichever ranks hold the chunks (one process, 2 or 4 real gloo ranks), for
the layers alone and for Llama with dropout; and the controls: another sum tree, or one matmul over the whole
split dimension, or Llama unsplit, differ."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.support.launch import REPO
from tests.support.ranks import end_rank
from torchtitan_rng.config import ConfigError, parse_args
from torchtitan_rng.models.llama.chunked import split_llama_chunks
from torchtitan_rng.models.llama.model import FLAVORS, Llama
from torchtitan_rng.parallel.invariant.reduction import norm_of, row_squares
from torchtitan_rng.parallel.invariant.streams import ChunkStreams, MicroBatchStreams
from torchtitan_rng.parallel import mode_of
from torchtitan_rng.parallel.invariant.chunks import (ChunkPlacement, column_chunks, fan_out, gathered_chunks,
                                                      row_chunks, tree_sum)

CHUNKS, DIM, HIDDEN, VOCAB, ROWS = 4, 24, 40, 32, 6


def _tensors() -> dict[str, torch.Tensor]:
    """An input and the weights of a SwiGLU layer and an output layer, magnitudes over several decades (so that
    the order of a sum shows in the bits)."""
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(ROWS, DIM, generator=g) * torch.logspace(-2, 2, DIM),
            "gate": torch.randn(HIDDEN, DIM, generator=g), "up": torch.randn(HIDDEN, DIM, generator=g),
            "down": torch.randn(DIM, HIDDEN, generator=g) * torch.logspace(-3, 3, HIDDEN),
            "output": torch.randn(VOCAB, DIM, generator=g)}


def _local(full: torch.Tensor, placement: ChunkPlacement, dim: int) -> torch.Tensor:
    """This rank's chunks of a weight split along ``dim``."""
    pieces = full.chunk(placement.chunks, dim=dim)
    return torch.cat([pieces[c] for c in placement.local], dim=dim)


def _run(placement: ChunkPlacement) -> dict[str, torch.Tensor]:
    """Forward and backward of SwiGLU (gate, up column-split; down row-split) then a column-split output layer
    gathered whole, with this rank's chunks: the output, the input's gradient and this rank's weight gradients."""
    full = _tensors()
    x = full["x"].clone().requires_grad_()
    weights = {"gate": (0, full["gate"]), "up": (0, full["up"]), "down": (1, full["down"]), "output": (0, full["output"])}
    params = {name: _local(w, placement, dim).requires_grad_() for name, (dim, w) in weights.items()}
    inputs = fan_out(x, placement)
    gates, ups = column_chunks(inputs, params["gate"], placement), column_chunks(inputs, params["up"], placement)
    h = row_chunks([F.silu(g) * u for g, u in zip(gates, ups)], params["down"], placement)
    logits = gathered_chunks(column_chunks(fan_out(h, placement), params["output"], placement), placement)
    logits.logsumexp(-1).sum().backward()
    return {"logits": logits.detach(), "h": h.detach(), "x.grad": x.grad,
            **{f"{name}.grad": p.grad for name, p in params.items()}}


def _whole(results: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The ranks' results as one process's: weight gradients put together along their split dimension."""
    dims = {"gate.grad": 0, "up.grad": 0, "down.grad": 1, "output.grad": 0}
    return {key: torch.cat([r[key] for r in results], dim=dims[key]) if key in dims else results[0][key]
            for key in results[0]}


def _llama(placement: ChunkPlacement | None, mesh: Any = None) -> dict[str, torch.Tensor]:
    """Llama's debug flavor (dropout on) split into this rank's chunks (None: not split), one micro-batch's
    forward and backward with the mode's streams: its loss and every parameter's whole gradient."""
    torch.manual_seed(0)
    model = Llama(FLAVORS["debug"])
    streams = MicroBatchStreams(seed=3)
    split = []
    if placement is not None:
        split = split_llama_chunks(model, placement, ChunkStreams(3, torch.device("cpu")), mesh)
    streams.hook_blocks([model.layers])
    tokens = torch.randint(256, (2, 17), generator=torch.Generator().manual_seed(1))
    streams.enter(step=1, slot=0)
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grads = {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
             for name, p in model.named_parameters()}
    params = list(model.parameters())
    dims = {id(module.weight): dim for module, dim in split}
    group = placement.group if placement is not None else None
    norm = norm_of(row_squares(params, group, dims, placement))
    return {"loss": loss.detach(), "norm": norm, **grads}


def _worker(rank: int, world: int, store: str, out: str) -> None:
    """All ``world`` ranks as one group (4 ranks: one chunk each), then in pairs (two chunks each)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    every = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pairs = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    whole, pair = ChunkPlacement(CHUNKS, world, rank, every.get_group()), ChunkPlacement(CHUNKS, 2, rank % 2,
                                                                                            pairs["tp"].get_group())
    results = {"all": _run(whole), "pair": _run(pair), "llama all": _llama(whole, every),
               "llama pair": _llama(pair, pairs["tp"])}
    torch.save(results, f"{out}.{rank}")
    end_rank()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.fixture(scope="module")
def placed(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, torch.Tensor]]]:
    """Each of 4 gloo ranks' results: chunks over all 4 ranks, and over pairs of ranks."""
    tmp_path = tmp_path_factory.mktemp("chunks")
    mp.spawn(_worker, args=(4, str(tmp_path / "store"), str(tmp_path / "out")), nprocs=4)
    return [torch.load(tmp_path / f"out.{rank}") for rank in range(4)]


def test_chunked_layers_same_bits_forward_and_backward_for_every_placement_of_chunks(
        placed: list[dict[str, dict[str, torch.Tensor]]]) -> None:
    torch.set_num_threads(1)
    one = _run(ChunkPlacement(CHUNKS))
    ranks = placed
    for placed in (_whole([r["all"] for r in ranks]), _whole([r["pair"] for r in ranks[:2]]),
                   _whole([r["pair"] for r in ranks[2:]])):
        assert placed.keys() == one.keys()
        for key in one:
            assert torch.equal(_bits(placed[key]), _bits(one[key])), f"{key} differs"
    for r in ranks:  # every rank holds the whole replicated values
        assert torch.equal(_bits(r["all"]["x.grad"]), _bits(one["x.grad"]))
        assert torch.equal(_bits(r["pair"]["logits"]), _bits(one["logits"]))


def test_llama_split_into_chunks_same_loss_gradient_and_norm_bits_on_1_2_and_4_ranks_unsplit_differs(
        placed: list[dict[str, dict[str, torch.Tensor]]]) -> None:
    """Heads and hidden features in 4 chunks, with attention dropout drawn per chunk: one process holding all
    four, two ranks two each, four ranks one each give the same loss, gradients and gradient norm; the control, the same model
    unsplit (one matmul per layer, the block's stream for the masks), differs."""
    torch.set_num_threads(1)
    one = _llama(ChunkPlacement(CHUNKS))
    for r in placed:
        for layout in ("llama all", "llama pair"):
            assert r[layout].keys() == one.keys()
            for key in one:
                assert torch.equal(_bits(r[layout][key]), _bits(one[key])), f"{layout}: {key} differs"
    unsplit = _llama(None)
    assert not torch.equal(_bits(unsplit["loss"]), _bits(one["loss"]))
    assert torch.allclose(unsplit["loss"], one["loss"], rtol=0.05)  # the same model: losses close, not equal


def test_another_tree_or_one_matmul_over_the_split_dimension_differs() -> None:
    """The controls: the same chunk partials summed left to right, or the row-split layer as one matmul, give
    other bits than the fixed tree (so the equality above is the tree's, not luck)."""
    torch.set_num_threads(1)
    full = _tensors()
    hidden = F.silu(F.linear(full["x"], full["gate"])) * F.linear(full["x"], full["up"])
    inputs, weights = hidden.chunk(CHUNKS, dim=1), full["down"].chunk(CHUNKS, dim=1)
    partials = [F.linear(x.contiguous(), w.contiguous()) for x, w in zip(inputs, weights)]
    tree = tree_sum(partials)
    left = ((partials[0] + partials[1]) + partials[2]) + partials[3]
    assert torch.equal(_bits(tree), _bits((partials[0] + partials[1]) + (partials[2] + partials[3])))
    assert not torch.equal(_bits(left), _bits(tree))
    assert not torch.equal(_bits(F.linear(hidden, full["down"])), _bits(tree))
    assert torch.allclose(left, tree, rtol=1e-4, atol=1e-3)  # the same sum, rounded otherwise


INVARIANT = ("--job.config_file", str(REPO / "train_configs" / "llama_debug.toml"), "--parallelism.world_size_invariant",
             "--training.global_batch_size", "16", "--training.local_batch_size", "4")


@pytest.mark.parametrize(("overrides", "processes", "fragment"), [
    (("--parallelism.tensor_parallel_degree", "3"), 3, "parallelism.tensor_parallel_degree = 3 does not divide "
     "parallelism.tensor_parallel_chunks = 4"),
    (("--parallelism.tensor_parallel_chunks", "8"), 1, "does not divide the model's 4 attention heads"),
    (("--parallelism.tensor_parallel_chunks", "3", "--model.flavor", "small"), 1,
     "does not divide the model's 8 attention heads"),
    (("--parallelism.tensor_parallel_chunks", "1", "--parallelism.tensor_parallel_degree", "2"), 2,
     "parallelism.tensor_parallel_degree = 2 does not divide parallelism.tensor_parallel_chunks = 1"),
])
def test_what_cannot_be_invariant_is_refused_in_one_line(overrides: tuple[str, ...], processes: int,
                                                         fragment: str) -> None:
    config = parse_args([*INVARIANT, *overrides])
    with pytest.raises(ConfigError) as refused:
        mode_of(config.parallelism).check_config(config, processes)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("--parallelism.world_size_invariant: ") and fragment in message, \
        message
    # The controls: 2 and 4 ranks split the default 4 chunks, and 2 chunks split the debug flavor.
    for degree, chunks in ((2, 4), (4, 4), (2, 2)):
        ok = parse_args([*INVARIANT, "--parallelism.tensor_parallel_degree", str(degree),
                         "--parallelism.tensor_parallel_chunks", str(chunks)])
        mode_of(ok.parallelism).check_config(ok, degree)
