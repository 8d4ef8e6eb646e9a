"""Where a world-size-invariant micro-batch draws its random numbers: keyed by (step, slot) before the model and
by (step, slot, layer) before each block, never by rank or pipeline stage.

Before a micro-batch's forward the global streams are seeded for its slot (what comes before the first block,
e.g. the embedding's dropout, draws from that); a forward pre-hook on each block seeds them again for that
block's layer. A pipeline stage that starts at block ``l`` therefore draws what one process running every block
draws, whatever ran on its rank before (another micro-batch, another stage). What follows the last block (norm,
output, loss) draws on from the last block's stream, on any layout.

A layer split into tensor chunks (``chunks.py``) draws each chunk's random numbers (attention dropout) from a
stream of its own (:class:`ChunkStreams`), so that the rank holding a chunk draws what one process draws for it.

The hook sits on the outermost module of a block (activation checkpointing's wrapper, compile's module), so
``torch.utils.checkpoint`` stashes the seeded state and its recomputation replays the same masks.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn

from torchtitan_rng import device as device_lib
from torchtitan_rng.rng import preserved_global_rng, seed_layer_streams, seed_micro_batch_streams, stream_seed


class MicroBatchStreams:
    """The streams of the micro-batch being computed: :meth:`enter` before its forward, the hooks of
    :meth:`hook_blocks` at each block."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.step = 0
        self.slot = 0

    def enter(self, step: int, slot: int) -> None:
        """Seed the global streams for micro-batch ``slot`` of ``step``; the blocks then reseed for their layer."""
        self.step, self.slot = step, slot
        seed_micro_batch_streams(self.seed, step, slot)

    def hook_blocks(self, block_lists: list[nn.ModuleList]) -> None:
        """Reseed before each block, by its layer index counted across the block lists (a pruned pipeline model
        keeps every block's index, so a stage's blocks get the whole model's layer numbers)."""
        layer = 0
        for blocks in block_lists:
            for block in blocks:
                block.register_forward_pre_hook(self._seed_for(layer))
                layer += 1

    def _seed_for(self, layer: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            seed_layer_streams(self.seed, self.step, self.slot, layer)
        return hook


class ChunkStreams:
    """The streams of the chunks of a split layer: :meth:`per_chunk` once per layer call, then each chunk's draws
    inside the context it returns for that chunk."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed = seed
        self.device = device

    def per_chunk(self) -> Callable[[int], ContextManager[None]]:
        """Draw one number from the block's stream (every layout draws it, at the same place in the block), and
        return the context in which chunk ``c`` draws from ``("tensor-chunk", number, c)``; leaving it puts the
        block's stream back. Activation checkpointing's recomputation restores the block's stream, so it draws
        the same number and replays the same masks."""
        draw = int(torch.randint(1 << 62, (), dtype=torch.int64))

        @contextlib.contextmanager
        def chunk(c: int) -> Iterator[None]:
            with preserved_global_rng(self.device):
                device_lib.seed_generators(stream_seed("tensor-chunk", self.seed, draw, c))
                yield
        return chunk
