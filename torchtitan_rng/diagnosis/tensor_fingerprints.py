"""``debug.tensor_fingerprint``: per step and per rank, a hash of every tensor a step consumes and produces.

Each rank appends one JSON line per step to ``{dump_folder}/tensor_fingerprints/rank{R}.jsonl``:

* ``batch``: per micro-batch this rank consumed, per batch entry (``input``/``labels``, Flux's entries), one hash
  per sample (row), position-sensitive (a reordered sample changes it);
* ``grad``: each gradient before clipping; ``param``: each parameter after the update;
* ``optim`` (at the steps a checkpoint is saved; every step with ``debug.fingerprint_optimizer_every_step``): each
  tensor of the optimizer state after the update (``NAME.exp_avg``...). Not at every step by default: with AdamW it
  is twice the parameters' bytes, and a step's update already shows in its parameters; where a checkpoint holds
  it, a resume's ``entering`` state is compared with it;
* ``entering`` (on the first step a process trains: after a resume, the state just loaded): ``param``/``optim``;
* ``loss``: each micro-batch's loss on this rank, before any reduction over ranks;
* ``modules`` (at step ``debug.fingerprint_modules_at_step``): ``[name, [input hashes], [output hashes], drew]``
  for every module call, in the order the calls ended (forward hooks, installed for that step only); ``drew`` is
  null when the call drew no random number from torch's generators, else a hash of their state entering it;
* ``config`` (rank 0, in the first line of each process): the run's resolved config, so that the locator can name
  the keys in which two runs differ.

A hash is a position-weighted sum of the elements' bit patterns as integers, modulo 2**32 (2**64 for 64-bit
elements): each element's bits times an odd weight of its place in the whole tensor (its row-major index, modulo
a prime, mixed). Integer arithmetic is exact whatever order it adds in; the hash is one reduction per tensor on
its device (the sums per residue, then a dot with the weights), kept on the device until the loss log's next
sync point, then read in one copy per device and written as an exact integer. It sees any single changed element
(an odd weight), a tensor changed as a whole, and elements put in other places (a weight loaded transposed, rows
permuted), unless each moved by a multiple of the prime. ``torch.hash_tensor`` XORs instead, where two equal
elements cancel: a norm weight of ones hashes to 0 before and after any uniform change. A sharded tensor (FSDP2) is
hashed as this rank's shard, each element weighed by its place in the whole tensor: the shards' hashes add up to
the whole tensor's, which is how the locator compares runs over another process count (``sharded`` names them, in
the first line that hashed each). A resumed run appends; a step written twice counts by its later line, as in the
loss log. Off, the trainer builds none of this: no hook, no per-step work.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._pytree import tree_leaves

from torchtitan_rng import device as device_lib
from torchtitan_rng.config import Debug
from torchtitan_rng.diagnosis.locator import prints_path
from torchtitan_rng.loss_log import LossLogWriter

# An odd multiplier per position (Knuth's golden-ratio constant, as a signed int64): a bijection of the bits.
_MIX = -0x61C8864680B583EB
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The elements' bit patterns as integers (a view: nothing is copied)."""
    tensor = tensor.detach()
    if tensor.is_floating_point() or tensor.dtype == torch.bool:
        return tensor.view(_INT_OF_SIZE[tensor.element_size()])
    return tensor


def tensor_hash(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d integer on the tensor's device: the sum of its elements' bit patterns, each times the odd weight of its
    place in the whole tensor, wrapping at 2**32 (2**64 for 64-bit elements); of this rank's shard of a sharded
    tensor, weighed by the shard's places in the whole. A place's weight is that of its row-major index in the whole
    tensor modulo ``_PERIOD``: the elements of each residue are summed in one reduction (a ``(-1, _PERIOD)`` view
    summed over its rows), then dotted with the weights. 32-bit sums of 32-bit elements run at the speed of a
    float sum; summing them into 64 bits converts each element first, about 20 times slower on a CPU."""
    bits = _bits(_local(tensor))
    accumulate = torch.int64 if bits.element_size() == 8 else torch.int32
    weights = _weights(bits.device, accumulate)
    start = _global_start(tensor)
    if start is None:  # not one block of the whole's row-major order (sharded along a later dimension)
        return _dot(bits.reshape(-1), weights[(_global_index(tensor) % _PERIOD).reshape(-1)], accumulate)
    flat = bits.reshape(-1)  # a copy only where the tensor is not contiguous: its places, not its memory
    first = start % _PERIOD
    head = min(flat.numel(), (_PERIOD - first) % _PERIOD)  # the elements before the first place of residue 0
    body = (flat.numel() - head) // _PERIOD * _PERIOD
    tail = flat.numel() - head - body
    parts = []  # (values, their weights); a small tensor is one part, its tail
    if head or not flat.numel():
        parts.append((flat[:head], weights[first:first + head]))
    if body:
        parts.append((flat[head:head + body].view(-1, _PERIOD).sum(dim=0, dtype=accumulate), weights))
    if tail:
        parts.append((flat[head + body:], weights[:tail]))
    total = _dot(*parts[0], accumulate)
    for values, part_weights in parts[1:]:
        total = total + _dot(values, part_weights, accumulate)
    return total


def _dot(values: torch.Tensor, weights: torch.Tensor, accumulate: torch.dtype) -> torch.Tensor:
    return (values.to(accumulate) * weights).sum(dtype=accumulate)  # a new tensor, even of one element


def _global_start(tensor: torch.Tensor) -> int | None:
    """The row-major index in the whole tensor where this rank's part starts, when its part is one block of that
    order (a plain tensor: 0; FSDP2's shard of whole rows); None when it is not."""
    if not isinstance(tensor, DTensor) or not any(isinstance(place, Shard) for place in tensor.placements):
        return 0
    shape, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(shape[1:]) != tuple(tensor.shape[1:]):
        return None
    return offsets[0] * math.prod(tensor.shape[1:])


def _global_index(tensor: DTensor) -> torch.Tensor:
    """Each local element's row-major index in the whole tensor (int64, the local shape)."""
    shape, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    device = tensor.to_local().device
    index = torch.zeros(shape, dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(len(shape))):
        view = [1] * len(shape)
        view[dim] = shape[dim]
        index += ((torch.arange(shape[dim], device=device) + offsets[dim]) * stride).view(view)
        stride *= tensor.shape[dim]
    return index


# Places are weighed by their index modulo this prime: a hash misses only elements moved by a multiple of it
# (a transposed square matrix under 65521 rows moves none so), and a tensor of at least this many elements is
# one reduction of a view, whatever its shape.
_PERIOD = 65521
_WEIGHTS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _weights(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The odd weight of each residue (cached per device): SplitMix64's finalizer of the residue, to the
    accumulator's width."""
    if (device, dtype) not in _WEIGHTS:
        x = np.arange(_PERIOD, dtype=np.uint64) + np.uint64(_MIX % 2**64)
        for shift, multiplier in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            x = (x ^ (x >> np.uint64(shift))) * np.uint64(multiplier)
        x = (x ^ (x >> np.uint64(31))) | np.uint64(1)
        low = (x & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        ints = x.view(np.int64) if dtype == torch.int64 else low.view(np.int32)
        _WEIGHTS[device, dtype] = torch.from_numpy(ints).to(device)
    return _WEIGHTS[device, dtype]


def row_hashes(tensor: torch.Tensor) -> torch.Tensor:
    """One int64 per row (sample) of a batch entry: each element's bits times an odd constant of its position."""
    bits = _bits(tensor)
    rows = bits.reshape(bits.shape[0] if bits.dim() else 1, -1).to(torch.int64)
    weights = (torch.arange(rows.shape[1], device=rows.device, dtype=torch.int64) * 2 + 1) * _MIX
    return (rows * weights).sum(dim=1)


class FingerprintWriter(LossLogWriter):
    """The loss log's append-only, fsynced, cut-line-safe file, for records whose tensors are integer hashes."""

    def flush(self) -> list[dict[str, Any]]:
        if not self.pending:
            return []
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for record in self.pending:
            _collect(record, by_device)
        values = {device: iter(torch.cat([t.reshape(-1) for t in tensors]).tolist())
                  for device, tensors in by_device.items()}  # one device-to-host copy per device
        written = [_fill(record, values) for record in self.pending]
        self.pending = []
        self._append("".join(json.dumps(record) + "\n" for record in written))
        return written


def _collect(value: Any, found: dict[torch.device, list[torch.Tensor]]) -> None:
    if isinstance(value, torch.Tensor):
        found.setdefault(value.device, []).append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, found)


def _fill(value: Any, values: dict[torch.device, Iterator[int]]) -> Any:
    """``value`` with each tensor replaced by its ints (in the order :func:`_collect` took them)."""
    if isinstance(value, torch.Tensor):
        ints = [next(values[value.device]) for _ in range(value.numel())]
        return ints if value.dim() else ints[0]
    if isinstance(value, dict):
        return {key: _fill(item, values) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_fill(item, values) for item in value]
    return value


class TensorFingerprints:
    """One rank's recorder; the trainer calls it around each step only when ``debug.tensor_fingerprint`` is on."""

    def __init__(self, debug: Debug, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, rank: int,
                 world_size: int, dump_folder: Path, config: dict[str, Any] | None = None) -> None:
        """``config``: the run's resolved config (``section.key``: value), written by rank 0 with the first step."""
        self.model, self.optimizer, self.world_size = model, optimizer, world_size
        self.config = config if rank == 0 else None
        self.modules_at = debug.fingerprint_modules_at_step
        self.optimizer_every_step = debug.fingerprint_optimizer_every_step
        self.params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.names = {id(p): name for name, p in self.params}
        self.sharded: set[str] = set()  # the names of sharded tensors hashed so far, written when new
        self.writer = FingerprintWriter(prints_path(dump_folder, rank))
        self.first = True
        self._sharded_now: set[str] = set()
        self.record: dict[str, Any] = {}
        self._updated: dict[str, Any] = {}  # the line of the last step whose update is done (``saving`` adds to it)
        self._hooks: list[Any] = []

    def batches(self, batches: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """The batches as the plan takes them, each hashed per entry and sample as it is taken."""
        for batch in batches:
            self.batch(batch)
            yield batch

    def batch(self, batch: dict[str, Any] | list[Any] | tuple[Any, ...] | torch.Tensor) -> None:
        """One micro-batch of this step, hashed per entry and sample: a dict's entries by key, a tuple's or list's
        by index (``"0"``, ``"1"``...), a lone tensor as ``input``."""
        if isinstance(batch, torch.Tensor):
            batch = {"input": batch}
        elif isinstance(batch, (list, tuple)):
            batch = {str(index): value for index, value in enumerate(batch)}
        self.record.setdefault("batch", []).append(
            {key: row_hashes(value) for key, value in batch.items() if isinstance(value, torch.Tensor)})

    def flush(self) -> None:
        """Write what is queued (a framework's save: its own sync point)."""
        self.writer.flush()

    def loss(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss as this rank computed it, before any reduction over ranks."""
        self.record.setdefault("loss", []).append(tensor_hash(loss))

    def step_begin(self, step: int) -> None:
        """Before the step's forward: the state entering it (first step of this process), hooks at the chosen step."""
        self.record = {"step": step, "world_size": self.world_size}
        if self.first:
            self.first = False
            self.record["entering"] = {"param": self._params(), "optim": self._optim()}
            if self.config is not None:
                self.record["config"] = self.config
        if step == self.modules_at:
            calls: list[Any] = []
            self.record["modules"] = calls
            entering: list[torch.Tensor] = []  # the streams' state entering each call not yet ended (nested)
            device = next(self.model.parameters()).device
            for name, module in self.model.named_modules():
                if name:
                    self._hooks.append(module.register_forward_pre_hook(
                        lambda module, args: entering.append(_stream_state(device))))
                    self._hooks.append(module.register_forward_hook(_module_hook(name, calls, entering, device),
                                                                    with_kwargs=True))

    def losses(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``loss_fn`` recording each micro-batch's loss as this rank computes it, before any reduction."""
        def recorded(*args: Any, **kwargs: Any) -> torch.Tensor:
            loss = loss_fn(*args, **kwargs)
            self.loss(loss)
            return loss
        return recorded

    def gradients(self) -> None:
        """After the backward, before clipping; the module hooks (if any) come off here."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.record["grad"] = {name: self._hash(name, p.grad) for name, p in self.params if p.grad is not None}

    def updated(self, flush: bool) -> None:
        """After the update: the parameters (and the optimizer state, where asked for every step); the line is
        queued (written at ``flush``)."""
        self.record["param"] = self._params()
        if self.optimizer_every_step:
            self.record["optim"] = self._optim()
        self._name_sharded(self.record)
        self._updated = self.record
        self.writer.write(self.record)
        if flush:
            self.writer.flush()

    def saving(self, step: int) -> None:
        """A checkpoint of the state after ``step`` is being saved: that step's line gets the optimizer state, and
        what is queued is written (a save reads the device anyway). Where the line was written already, it is
        written again whole, and the later line counts."""
        line = self._updated
        if line.get("step") == step and "optim" not in line:
            line["optim"] = self._optim()
            self._name_sharded(line)
            if not any(queued is line for queued in self.writer.pending):
                self.writer.write(line)
        self.writer.flush()

    def _name_sharded(self, line: dict[str, Any]) -> None:
        """The sharded tensors hashed for the first time, named in ``line``."""
        if new := sorted(self._sharded_now - self.sharded):
            line["sharded"] = sorted({*line.get("sharded", []), *new})
            self.sharded.update(new)
        self._sharded_now = set()

    def _hash(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, DTensor) and any(isinstance(place, Shard) for place in tensor.placements):
            self._sharded_now.add(name)
        return tensor_hash(tensor)

    def _params(self) -> dict[str, torch.Tensor]:
        return {name: self._hash(name, p) for name, p in self.params}

    def _optim(self) -> dict[str, torch.Tensor]:
        prints: dict[str, torch.Tensor] = {}
        for param, state in (self.optimizer.state if self.optimizer is not None else {}).items():
            name = self.names.get(id(param), "?")
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    prints[f"{name}.{key}"] = self._hash(f"{name}.{key}", value)
        return prints

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self.writer.close()


def _stream_state(device: torch.device) -> torch.Tensor:
    """torch's CPU generator and this rank's device generator, as one byte tensor (what dropout draws from)."""
    device_state = device_lib.get_device_rng_state(device)
    cpu = torch.get_rng_state()
    return cpu if device_state is None else torch.cat([cpu, device_state.cpu()])


def _module_hook(name: str, calls: list[Any], entering: list[torch.Tensor], device: torch.device) -> Any:
    def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        before = entering.pop()
        drew = None if torch.equal(before, _stream_state(device)) else tensor_hash(before)
        calls.append([name, [tensor_hash(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)],
                      [tensor_hash(t) for t in tree_leaves(output) if isinstance(t, torch.Tensor)], drew])
    return hook


def build_tensor_fingerprints(debug: Debug, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, rank: int,
                              world_size: int, dump_folder: Path,
                              config: dict[str, Any] | None = None) -> TensorFingerprints | None:
    """The recorder, or None when ``debug.tensor_fingerprint`` is off (the trainer then does nothing per step)."""
    if not debug.tensor_fingerprint:
        return None
    return TensorFingerprints(debug, model, optimizer, rank=rank, world_size=world_size, dump_folder=dump_folder,
                              config=config)
