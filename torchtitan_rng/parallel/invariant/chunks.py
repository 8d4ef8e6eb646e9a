"""Tensor-split layers with the same bits at every tensor-parallel degree: each split dimension is cut into a
fixed number of chunks ``C`` (``parallelism.tensor_parallel_chunks``), whatever the degree ``T`` that divides it.

A rank of a tensor-parallel group of ``T`` holds chunks ``rank * C/T .. (rank + 1) * C/T - 1``; one process holds
all ``C``. Every layout computes each chunk's matmul by itself (the same shapes, so the same kernel and the same
bits whether a rank holds one chunk or all of them), and where a split layer needs a sum over chunks it is taken
by :func:`tree_sum`, one fixed tree over the chunk index:

* a column-split layer (the output features split): the forward needs no sum; the input gradient is the sum of
  every chunk's partial (:func:`column_chunks`);
* a row-split layer (the input features split): the output is the sum of every chunk's partial
  (:func:`row_chunks`); its backward needs no sum;
* a column-split output gathered whole (:func:`gathered_chunks`): a concatenation, no sum.

Between ranks the partials are exchanged whole (one all-gather of each rank's chunks) and every rank adds them
itself: the collective never does the arithmetic, so neither the degree nor the collective's algorithm enters
the sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

# The name of the mesh dimension whose ranks split the layers (the layouts name it so, as torchtitan does).
TENSOR_DIM = "tp"


@dataclass(frozen=True)
class ChunkPlacement:
    """``chunks`` per split dimension over ``degree`` ranks of ``group`` (None: one process holds them all);
    this rank is ``rank`` of the group."""

    chunks: int
    degree: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        assert self.chunks % self.degree == 0, "the launcher refuses a degree that does not divide the chunks"

    @property
    def per_rank(self) -> int:
        """Chunks each rank holds."""
        return self.chunks // self.degree

    @property
    def local(self) -> range:
        """The chunk indices this rank holds."""
        return range(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)


def tree_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of ``parts`` (one per chunk, in chunk order) by one fixed tree: neighbours added pairwise, level by
    level (``(p0 + p1) + (p2 + p3)`` for four); an odd last part goes up a level as it is."""
    level = list(parts)
    while len(level) > 1:
        paired = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
        level = paired + ([level[-1]] if len(level) % 2 else [])
    return level[0]


def _all_chunks(local: Sequence[torch.Tensor], placement: ChunkPlacement) -> list[torch.Tensor]:
    """Every chunk's tensor in chunk order, from this rank's (equal shapes): moved, never added."""
    if placement.degree == 1:
        return list(local)
    mine = torch.stack([part.contiguous() for part in local])
    every = torch.empty((placement.degree * mine.shape[0], *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
    dist.all_gather_into_tensor(every, mine, group=placement.group)
    return list(every.unbind(0))


class _FanOut(torch.autograd.Function):
    """One alias of the input per local chunk; the backward sums every chunk's input gradient by the tree."""

    @staticmethod
    def forward(ctx: Any, placement: ChunkPlacement, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.placement = placement
        return tuple(x.view_as(x) for _ in placement.local)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, torch.Tensor]:
        # A chunk whose output was not used has no gradient: zeros, so that the tree keeps its shape.
        present = next(g for g in grads if g is not None)
        local = [g if g is not None else torch.zeros_like(present) for g in grads]
        return None, tree_sum(_all_chunks(local, ctx.placement))


class _GatherSum(torch.autograd.Function):
    """Every chunk's partial gathered and summed by the tree (the same value on every rank); the backward hands
    each local partial the output's gradient."""

    @staticmethod
    def forward(ctx: Any, placement: ChunkPlacement, *partials: torch.Tensor) -> torch.Tensor:
        ctx.count = len(partials)
        return tree_sum(_all_chunks(partials, placement))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return (None, *(grad for _ in range(ctx.count)))


class _GatherCat(torch.autograd.Function):
    """Every chunk's part gathered and concatenated along ``dim`` in chunk order; the backward hands each local
    part its slice of the gradient."""

    @staticmethod
    def forward(ctx: Any, placement: ChunkPlacement, dim: int, *parts: torch.Tensor) -> torch.Tensor:
        ctx.placement, ctx.dim = placement, dim
        return torch.cat(_all_chunks(parts, placement), dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        placement = ctx.placement
        pieces = grad.chunk(placement.chunks, dim=ctx.dim)
        return (None, None, *(pieces[c].contiguous() for c in placement.local))


def fan_out(x: torch.Tensor, placement: ChunkPlacement) -> tuple[torch.Tensor, ...]:
    """``x`` once per local chunk, for the chunks' column-split layers to read: their input gradients come back
    summed over all ``C`` chunks by the tree (exchanged between the ranks), the same bits at every degree. Use one
    alias for every layer of a chunk that reads ``x`` (their two gradients add in either order to the same
    bits)."""
    return _FanOut.apply(placement, x)


def column_chunks(inputs: Sequence[torch.Tensor], weight: torch.Tensor, placement: ChunkPlacement) -> list[torch.Tensor]:
    """A column-split linear layer: ``weight`` holds this rank's chunks' output rows (``per_rank`` equal row
    blocks), ``inputs`` one alias of the input per local chunk (:func:`fan_out`); each chunk's output by its own
    matmul."""
    return [F.linear(x, w) for x, w in zip(inputs, weight.chunk(placement.per_rank, dim=0), strict=True)]


def row_chunks(inputs: Sequence[torch.Tensor], weight: torch.Tensor, placement: ChunkPlacement) -> torch.Tensor:
    """A row-split linear layer: ``weight`` holds this rank's chunks' input columns (``per_rank`` equal column
    blocks), ``inputs`` each local chunk's input; each chunk's partial output by its own matmul (on a contiguous
    copy of its columns, so that the kernel sees the same strides at every degree), summed over all ``C`` chunks
    by the tree: the whole output, the same on every rank."""
    weights = [w.contiguous() for w in weight.chunk(placement.per_rank, dim=1)]
    partials = [F.linear(x, w) for x, w in zip(inputs, weights, strict=True)]
    return _GatherSum.apply(placement, *partials)


def gathered_chunks(parts: Sequence[torch.Tensor], placement: ChunkPlacement, dim: int = -1) -> torch.Tensor:
    """Local chunks' outputs of a column-split layer, concatenated with every other rank's along ``dim`` in chunk
    order: the whole output on every rank."""
    return _GatherCat.apply(placement, dim, *parts)
