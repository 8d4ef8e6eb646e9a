"""Sums in a canonical order: one balanced binary tree over the global micro-batch index.

Floating-point addition is commutative (``a + b`` and ``b + a`` are the same bits) but not associative, so a
sum is reproducible only if its tree is. The tree over micro-batches ``[lo, hi)`` splits at
``lo + (hi - lo) // 2``. With ``M`` micro-batches and a power-of-two process count ``W`` dividing ``M``,
repeated halving of ``[0, M)`` yields exactly the ``W`` contiguous blocks of ``M / W`` micro-batches, one per
rank, as subtrees. So: each rank sums its block with :func:`tree_sum`, then :func:`butterfly_sum` adds the
blocks pairwise across ranks, level by level (ranks ``r`` and ``r ^ 1``, then ``r ^ 2``, ...). Each pairwise
sum is a single commutative addition, so both partners hold the same bits, and the levels are the top of
the same tree. 1, 2, 4, 8... processes compute the same tree, hence the same bits.

A plain all-reduce over more than 2 ranks (ring, tree or halving-doubling, chosen by the backend by message
size) or a reduce-scatter does not fix the tree, and is not used here.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


def tree_sum(lo: int, hi: int, leaf: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """The canonical-tree sum of ``leaf(j)`` for j in ``[lo, hi)``; leaves are produced in increasing j, and
    at most ``log2(hi - lo) + 1`` partial sums are alive at once. The result may be a leaf's own tensor."""
    if hi - lo == 1:
        return leaf(lo)
    mid = lo + (hi - lo) // 2
    left = tree_sum(lo, mid, leaf)
    return left.add_(tree_sum(mid, hi, leaf))


def butterfly_sum(partial: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Add ``partial`` (this rank's block) across ``world`` ranks (a power of two) in the canonical tree, in
    place; every rank returns the same bits. ``log2(world)`` point-to-point exchanges between ranks of the
    default process group."""
    received = torch.empty_like(partial) if world > 1 else partial
    distance = 1
    while distance < world:
        partner = rank ^ distance
        ops = [dist.P2POp(dist.isend, partial, partner), dist.P2POp(dist.irecv, received, partner)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        partial.add_(received)  # a + b == b + a bit for bit: the partner computes the same sum
        distance *= 2
    return partial
