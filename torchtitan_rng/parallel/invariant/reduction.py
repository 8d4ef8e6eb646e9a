"""Sums with one order at every process count: the step's gradient, its loss and its gradient norm.

Floating-point addition is commutative (``a + b`` and ``b + a`` are the same bits) but not associative, so a
sum is reproducible only if its order is. A step's ``M`` micro-batches are numbered by global slot, and rank
``r`` of ``W`` processes runs slots ``r, r + W, r + 2W, ...`` (``step.Slots``): round ``i`` of the step runs
slots ``iW .. iW + W - 1``, one on each rank. The step's gradient is the float32 sum ``g_0 + g_1 + ... +
g_{M-1}`` taken strictly left to right (the first assigned, each next one added), then divided by ``M``.

* One process: autograd's accumulation into ``.grad`` is exactly that sum (the first backward assigns, each
  next adds elementwise).
* ``W`` processes: FSDP2 shards the parameters, and after each round's backward it would reduce-scatter the
  ranks' gradients, adding them in an order the backend picks by size and count. :class:`SlotOrderExchange`
  takes its place: an all-to-all hands each rank's slice of its gradient to the slice's owner *without adding*
  (the bytes a ring reduce-scatter moves: ``(W - 1) / W`` of the gradient per rank per micro-batch), and the
  owner adds the ``W`` slices into its accumulated shard in slot order. Elementwise, in the same order as one
  process: the same bits, for any ``W`` that divides ``M``.

The result is an ordinary float32 sum (the rounding of one process accumulating ``M`` micro-batches), not an
exact one; what is invariant is the order. The gradient norm for clipping is summed in an order fixed by the
parameters' shapes alone (:func:`grad_norm`).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter  # set_custom_reduce_scatter's interface
from torch.distributed.tensor import DTensor

from torchtitan_rng.errors import ConfigError
from torchtitan_rng.parallel.invariant.chunks import TENSOR_DIM, ChunkPlacement, tree_sum


class SlotOrderExchange(ReduceScatter):
    """FSDP2's reduce-scatter of one sharded module, replaced: receive every rank's slice of this rank's shard
    and add them in rank (= slot) order into the shard the step accumulates. FSDP2 then views that shard as the
    parameters' ``.grad``; the layout clears ``.grad`` between rounds so that FSDP2 assigns
    the views again instead of adding them to themselves."""

    def __init__(self) -> None:
        self.shard: torch.Tensor | None = None  # the step's accumulated gradient shard of this module
        self._first_round = True
        self._input_next = True  # FSDP2 allocates the input of a reduction, then its output

    def begin_step(self) -> None:
        self._first_round = True

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        is_input, self._input_next = self._input_next, not self._input_next
        if is_input:
            return torch.empty(size, dtype=dtype, device=device)
        if self.shard is None or self.shard.numel() != math.prod(size) or self.shard.dtype != dtype:
            if not self._first_round:  # FSDP2 leaves out a parameter that got no gradient: the sum would break
                raise ConfigError("parallelism.world_size_invariant needs a gradient for every trainable parameter "
                                  "in every micro-batch; freeze (requires_grad=False) the parameters a forward "
                                  "does not use")
            self.shard = torch.empty(size, dtype=dtype, device=device)
        return self.shard  # the output is the accumulator: the step's sum so far

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object = None, async_op: bool = False) -> None:
        assert output_tensor is self.shard, "FSDP2 reduces into the buffer allocate() returned"
        world = group.size()
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)  # chunk k: rank k's slice of this shard
        pieces = received.view(world, -1)
        start = 0
        if self._first_round:
            output_tensor.copy_(pieces[0])  # the first slot is assigned, as autograd assigns a first gradient
            start, self._first_round = 1, False
        for k in range(start, world):
            output_tensor.add_(pieces[k])
        return None


def use_slot_order_exchange(model: nn.Module) -> list[SlotOrderExchange]:
    """Give every FSDP2 module of ``model`` its exchange (no division: the step divides by ``M`` itself)."""
    exchanges = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            exchange = SlotOrderExchange()
            module.set_custom_reduce_scatter(exchange)
            module.set_gradient_divide_factor(1.0)
            exchanges.append(exchange)
    return exchanges


def _row_chunk(rows: int, world: int) -> int:
    return -(-rows // world)  # FSDP2 shards dim 0 in chunks of ceil(rows / world), as torch.chunk does


def _row_squares(grad: torch.Tensor) -> torch.Tensor:
    """Per row (index along dim 0) the sum of squares in float64: each row lies whole on one rank, and its sum
    is the same kernel on the same elements at every process count."""
    rows = grad.reshape(grad.shape[0] if grad.dim() else 1, -1)
    return rows.double().square().sum(dim=1)


def _shards(grad: torch.Tensor) -> tuple[tuple[int, int], tuple[int, int]]:
    """((rank, ranks) of the tensor-parallel split, (rank, ranks) of FSDP2's row shards) of a gradient: read from
    its DTensor placements (the mesh dimension named ``tp`` splits it over tensor-parallel ranks, any other over
    data shards); ((0, 1), (0, 1)) for a plain tensor."""
    split, shard = (0, 1), (0, 1)
    if isinstance(grad, DTensor):
        mesh = grad.device_mesh
        names = mesh.mesh_dim_names or (None,) * mesh.ndim
        for index, (name, placement) in enumerate(zip(names, grad.placements)):
            if placement.is_shard():
                place = (mesh.get_local_rank(index), mesh.size(index))
                split, shard = (place, shard) if name == TENSOR_DIM else (split, place)
    return split, shard


def row_squares(params: list[nn.Parameter], group: dist.ProcessGroup | None = None,
                split_dims: dict[int, int] | None = None, placement: ChunkPlacement | None = None) -> list[torch.Tensor]:
    """Per parameter with a gradient (in ``params`` order) the float64 sums of squares of all its rows
    (:func:`_row_squares`), the same vector on every rank of ``group`` (default: all ranks), which hold the
    parameters between them (sharded by FSDP2 along rows, split over tensor-parallel ranks).

    ``split_dims``: the dimension a weight split into tensor chunks is split along (by ``id`` of the parameter;
    ``placement``: the chunks and this rank's place among them). A weight split along its input features (dim 1)
    has each row's chunks summed apart, then added by the chunk tree (``chunks.tree_sum``), at every degree; a
    weight every tensor-parallel rank holds whole counts once. Each rank writes the rows it holds into a vector
    with a place for every row (and chunk) of every parameter, zeros elsewhere; one all-reduce adds them, every
    place being written by exactly one rank, so that no order of that sum changes a bit (``x + 0 = x``)."""
    split_dims, placement = split_dims or {}, placement or ChunkPlacement(1)
    held = [(p.grad, split_dims.get(id(p))) for p in params if p.grad is not None]
    sizes = [(g.shape[0] if g.dim() else 1) * (placement.chunks if dim == 1 else 1) for g, dim in held]
    device = held[0][0].device if held else torch.device("cpu")
    vector = torch.zeros(sum(sizes), dtype=torch.float64, device=device)
    offset = 0
    for (grad, dim), size in zip(held, sizes):
        (split_rank, split_ranks), (shard_rank, shard_ranks) = _shards(grad)
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        rows = grad.shape[0] if grad.dim() else 1
        whole_here = split_ranks == 1 and dim is None
        if local.numel() and (not whole_here or placement.rank == 0):
            split_rows = rows // split_ranks if dim == 0 else rows
            start = shard_rank * _row_chunk(split_rows, shard_ranks) + (split_rank * split_rows if dim == 0 else 0)
            if dim == 1:
                held_chunks = placement.chunks // split_ranks
                width = local.shape[1] // held_chunks
                for index in range(held_chunks):
                    squares = _row_squares(local[:, index * width:(index + 1) * width].contiguous())
                    at = offset + (split_rank * held_chunks + index) * rows + start
                    vector[at:at + squares.numel()] = squares
            else:
                squares = _row_squares(local)
                vector[offset + start:offset + start + squares.numel()] = squares
        offset += size
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(vector, group=group)
    parts, offset = [], 0
    for (grad, dim), size in zip(held, sizes):
        part = vector[offset:offset + size]
        parts.append(tree_sum(part.view(placement.chunks, -1).unbind(0)) if dim == 1 else part)
        offset += size
    return parts


def norm_of(parts: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm from every parameter's row squares, in the order given: one kernel on one vector, so the same
    vector gives the same bits wherever it was gathered."""
    return torch.cat(parts).sum().sqrt().float()


def grad_norm(params: list[nn.Parameter], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The 2-norm of all gradients, the same bits at every process count: per-row float64 sums of squares in
    parameter-and-row order (:func:`row_squares`), summed by one kernel on that identical vector."""
    return norm_of(row_squares(params, group))


def clip_grads(params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> torch.Tensor:
    """Scale the gradients to norm ``max_norm`` when their total ``norm`` is above it (no clipping when
    ``max_norm <= 0``), as torch's clip_grad_norm_ does; returns ``norm`` (non-finite stays so)."""
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                local.mul_(scale.to(local.dtype))
    return norm
