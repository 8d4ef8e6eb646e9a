"""A streaming source: token windows read front to back, shuffled through a buffer that is saved with the checkpoint.

For data too large to index (no permutation over all samples): the file is cut into consecutive windows of
``seq_len + 1`` tokens, window ``i`` belonging to stream ``i % S`` where there are ``S = dp_world x
max(num_workers, 1)`` streams (rank ``r``'s worker ``w`` reads stream ``r x workers + w``), so the ranks and
workers read disjoint shares. Each stream keeps a shuffle buffer of ``data.shuffle_buffer`` windows and
yields one drawn by its own generator, refilling from the file.

A checkpoint holds, per stream, the file position, the buffer's contents (tokens and window ids) and the
buffer generator's state, so the resumed stream yields exactly the windows the uninterrupted one would.
At the end of the file (or after ``data.num_samples`` windows) the buffer is drained, then the next
epoch reads the file again from the start with a generator seeded from ``(seed, stream, epoch)``.

The split into streams is part of the state: resuming with another ``data.num_workers`` or process count
is refused (the map-style path can do that; a stream cannot be re-split without re-reading the file).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan_rng.checkpoint.codec import decode_state, encode_state
from torchtitan_rng.config import ConfigError
from torchtitan_rng.checkpoint.layout import dp_rank_key
from torchtitan_rng.data.dataloader import CountingIterator, built_quietly
from torchtitan_rng.signals import ignore_checkpoint_signals
from torchtitan_rng.rng import stream_generator


class TokenReader(Protocol):
    """Sequential access to a token file (``token_files.ArrayReader`` and ``JsonlReader``)."""

    def read(self, count: int) -> np.ndarray | None: ...
    def skip(self, count: int) -> bool: ...
    def restart(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class WindowStream(IterableDataset):
    """Token windows of a file, shuffled per stream; ``iter()`` gives this process's (or worker's) stream.

    ``open_reader`` must pickle (workers call it): e.g. ``functools.partial(JsonlReader, path)``.
    Batches hold ``input``, ``labels`` and ``window`` (the window's index in the file).
    """

    def __init__(self, open_reader: Callable[[], TokenReader], *, seq_len: int, seed: int, buffer_size: int,
                 windows_per_epoch: int = 0, source: str = "the data") -> None:
        self.open_reader = open_reader
        self.stride = seq_len + 1
        self.seed = seed
        self.buffer_size = buffer_size
        self.windows_per_epoch = windows_per_epoch
        self.source = source
        self.dp_rank, self.dp_world = 0, 1

    def assign_rank(self, dp_rank: int, dp_world: int) -> None:
        self.dp_rank, self.dp_world = dp_rank, dp_world

    def __iter__(self) -> ShuffledShard:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return ShuffledShard(self, self.dp_rank * workers + worker, self.dp_world * workers)


class ShuffledShard:
    """One stream of a :class:`WindowStream`: its file position, shuffle buffer and generator (Stateful)."""

    def __init__(self, stream: WindowStream, shard: int, shards: int) -> None:
        self.stream = stream
        self.shard, self.shards = shard, shards
        self.reader = stream.open_reader()
        self._start_epoch(0)

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.reader.restart()
        self.window = 0  # index in the file of the next window not yet read or skipped
        self.exhausted = False
        self.buffer_ids: list[int] = []
        self.buffer: list[np.ndarray] = []
        self.generator = stream_generator("stream-shuffle", self.stream.seed, self.shard, epoch)

    def _read_own_window(self) -> bool:
        """Put this stream's next window into the buffer; False at the end of the epoch."""
        stride, limit = self.stream.stride, self.stream.windows_per_epoch
        target = self.window + (self.shard - self.window) % self.shards
        if limit and target >= limit:
            return False
        if target > self.window and not self.reader.skip((target - self.window) * stride):
            return False
        tokens = self.reader.read(stride)
        if tokens is None:
            return False
        self.buffer_ids.append(target)
        self.buffer.append(tokens)
        self.window = target + 1
        return True

    def __iter__(self) -> ShuffledShard:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        while True:
            while not self.exhausted and len(self.buffer) < self.stream.buffer_size:
                self.exhausted = not self._read_own_window()
            if self.buffer:
                break
            if self.window <= self.shard:  # not one window of this stream in the whole epoch
                raise ConfigError(
                    f"config training.dataset_path: {self.stream.source} is too short to give each of {self.shards} "
                    f"streams (processes x dataloader workers) one window of {self.stream.stride} tokens"
                )
            self._start_epoch(self.epoch + 1)
        drawn = int(torch.randint(len(self.buffer), (1,), generator=self.generator))
        window_id, tokens = self.buffer_ids[drawn], self.buffer[drawn]
        # The last entry takes the drawn one's place: O(1), and part of the saved order like everything else.
        self.buffer_ids[drawn], self.buffer[drawn] = self.buffer_ids[-1], self.buffer[-1]
        self.buffer_ids.pop()
        self.buffer.pop()
        sample = torch.from_numpy(tokens.astype(np.int64))
        return {"input": sample[:-1], "labels": sample[1:], "window": torch.tensor(window_id)}

    def state_dict(self) -> dict[str, Any]:
        buffer = np.stack(self.buffer) if self.buffer else np.zeros((0, self.stream.stride), dtype=np.uint16)
        return {
            "shard": self.shard, "shards": self.shards, "epoch": self.epoch, "window": self.window,
            "exhausted": self.exhausted, "reader": self.reader.state_dict(),
            "buffer_ids": torch.tensor(self.buffer_ids, dtype=torch.int64),
            "buffer": torch.from_numpy(buffer),
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (int(state["shard"]), int(state["shards"])) != (self.shard, self.shards):
            raise ConfigError(f"a saved stream {state['shard']} of {state['shards']} cannot resume as stream "
                              f"{self.shard} of {self.shards}")
        self._start_epoch(int(state["epoch"]))
        self.window, self.exhausted = int(state["window"]), bool(state["exhausted"])
        self.reader.load_state_dict(state["reader"])
        self.buffer_ids = [int(i) for i in state["buffer_ids"].tolist()]
        self.buffer = list(state["buffer"].numpy())
        self.generator.set_state(state["generator"])


def _worker_error_message(message: str) -> str:
    """The message a worker raised, without the traceback text torch adds when it re-raises it here."""
    last = message.strip().splitlines()[-1]
    return last.split("ConfigError: ", 1)[-1]


class _StreamBatches(CountingIterator):
    def __next__(self) -> Any:
        try:
            return super().__next__()
        except ConfigError as err:  # a bad line met while streaming (in a worker or here): one line
            raise ConfigError(_worker_error_message(str(err))) from None


class StreamingDataLoader(StatefulDataLoader):
    """The loader of a :class:`WindowStream`, with :class:`ResumableDataLoader`'s checkpoint convention.

    Its state lives under ``dp_rank_{r}``: torchdata's state, which holds every worker's (or, without
    workers, this process's) :class:`ShuffledShard` state, plus the split it was read with.
    """

    def __init__(self, stream: WindowStream, *, batch_size: int, dp_rank: int, dp_world: int, seed: int,
                 num_workers: int = 0, prefetch_factor: int = 2, snapshot_every_n_steps: int = 1) -> None:
        stream.assign_rank(dp_rank, dp_world)
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.num_workers_configured = num_workers
        with built_quietly():
            super().__init__(
                stream,
                batch_size=batch_size,
                num_workers=num_workers,
                prefetch_factor=prefetch_factor if num_workers > 0 else None,
                # Its own generator: the workers' base seed must not be drawn from the global CPU stream.
                generator=stream_generator("dataloader", seed, dp_rank),
                snapshot_every_n_steps=snapshot_every_n_steps,
                worker_init_fn=ignore_checkpoint_signals,
            )
        self.batches_since_load = 0

    def __iter__(self) -> Iterator[Any]:
        return _StreamBatches(super().__iter__(), self)

    def state_dict(self) -> dict[str, Any]:
        # Not iterated since construction or the last load: the pending state (None: the start), without
        # starting workers only to ask them.
        loader_state = self.next_iter_state if self._iterator is None else super().state_dict()
        state = {"stream": True, "num_workers": self.num_workers_configured, "dp_world": self.dp_world,
                 "loader": loader_state}
        return {dp_rank_key(self.dp_rank): encode_state(state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches_since_load = 0
        state = decode_state(state_dict[dp_rank_key(self.dp_rank)])
        if not state.get("stream"):
            raise ConfigError("the checkpoint's data came from the map-style dataset and this run streams "
                              "(data.streaming): resume without --data.streaming, or start a new run")
        saved_workers, saved_world = int(state["num_workers"]), int(state["dp_world"])
        if (saved_workers, saved_world) != (self.num_workers_configured, self.dp_world):
            raise ConfigError(
                f"the checkpoint's stream was split over {saved_world} process(es) x {saved_workers} dataloader "
                f"worker(s) and this run has {self.dp_world} x {self.num_workers_configured}: each share's file "
                f"position and shuffle buffer belong to that split; resume with --data.num_workers {saved_workers} "
                f"on {saved_world} process(es)"
            )
        if state["loader"] is not None:
            super().load_state_dict(state["loader"])
