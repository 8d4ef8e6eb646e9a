"""Every random stream of a run, in one place.

Two kinds of stream (see README "Where randomness lives"):

* Global streams, captured per rank at a step boundary and restored last before the first resumed step:
  Python ``random``, NumPy's global RNG, torch's CPU generator, this rank's device generator (through
  ``device.py``), and generators registered by name with :func:`register_generator`.
* Derived streams: a generator seeded from ``(seed, purpose, indices...)`` by :func:`derive_seed`. They do
  not depend on worker count, prefetching or what ran before, so they resume exactly with no saved state.

Which streams are shared across ranks and which are per rank (the one place this is written down):

* shared by all ranks: model initialisation (``seed_model_init``), the sampler's epoch permutation and the
  Flux validation batch (derived from ``seed`` without a rank);
* per rank: the global training streams (dropout, diffusion noise, timesteps, prompt dropout) seeded by
  ``seed_training_streams`` from ``derive_seed(seed, "training-streams", rank)``, and the dataloader's
  worker seeds (``derive_seed(seed, "dataloader", dp_rank)``).
* per micro-batch, in world-size-invariant training (``parallelism.world_size_invariant``): the global
  training streams are seeded before every micro-batch from ``derive_seed(seed, "micro-batch", step, slot)``
  by ``seed_micro_batch_streams``; no rank owns a stream, and a resume restores none.
"""

from __future__ import annotations

import hashlib
import random
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch

from torchtitan_rng import device as device_lib

_registered: dict[str, torch.Generator] = {}


def derive_seed(seed: int, *keys: int | str) -> int:
    """A 63-bit seed that depends on ``seed`` and every key, and on nothing else (fold-in style)."""
    digest = hashlib.blake2b(repr((int(seed),) + tuple(keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def derived_generator(seed: int, *keys: int | str, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch generator for one purpose, e.g. ``derived_generator(seed, "augment", epoch, index)``."""
    return torch.Generator(device=device).manual_seed(derive_seed(seed, *keys))


def derived_numpy_generator(seed: int, *keys: int | str) -> np.random.Generator:
    """The NumPy twin of :func:`derived_generator`."""
    return np.random.default_rng(derive_seed(seed, *keys))


def register_generator(name: str, generator: torch.Generator) -> None:
    """Make ``generator`` part of the captured global streams (saved and restored with the checkpoint)."""
    _registered[name] = generator


def registered_generators() -> dict[str, torch.Generator]:
    return dict(_registered)


def seed_model_init(seed: int) -> None:
    """Shared across ranks: every rank builds the same initial weights."""
    torch.manual_seed(derive_seed(seed, "model-init"))


def seed_training_streams(seed: int, rank: int) -> None:
    """Per rank: the global streams a fresh run trains with (a resumed run restores them instead)."""
    _seed_global_streams(derive_seed(seed, "training-streams", rank))


def seed_micro_batch_streams(seed: int, step: int, slot: int) -> None:
    """World-size-invariant training: the global and registered streams of micro-batch ``slot`` of ``step``."""
    _seed_global_streams(derive_seed(seed, "micro-batch", step, slot))
    for name, generator in _registered.items():
        generator.manual_seed(derive_seed(seed, "micro-batch", step, slot, name))


def _seed_global_streams(value: int) -> None:
    random.seed(value)
    np.random.seed(value % (1 << 32))
    torch.manual_seed(value)  # also seeds every accelerator generator


def capture_host_rng() -> dict[str, Any]:
    """This process's Python, NumPy and torch CPU streams as tensors and plain values (no unpickling)."""
    py_version, py_internal, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "python": {
            "version": py_version,
            "internal": torch.tensor(py_internal, dtype=torch.int64),
            "gauss_next": py_gauss,
        },
        "numpy": {
            "name": np_name,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "torch_cpu": torch.get_rng_state(),
    }


def capture_global_rng(device: torch.device) -> dict[str, Any]:
    """This rank's global streams: the host ones, the device generator and the registered generators."""
    return {
        **capture_host_rng(),
        "device_type": device.type,
        "device": device_lib.get_device_rng_state(device),
        "registered": {name: gen.get_state() for name, gen in _registered.items()},
    }


def restore_host_rng(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_host_rng` took."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["internal"].tolist()), py["gauss_next"]))
    npst = state["numpy"]
    np.random.set_state(
        (npst["name"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"], npst["cached_gaussian"])
    )
    torch.set_rng_state(state["torch_cpu"])


def restore_global_rng(state: dict[str, Any], device: torch.device, *, include_device: bool = True) -> None:
    """Put back what :func:`capture_global_rng` took. Call it last, right before the first resumed step."""
    restore_host_rng(state)
    if include_device and state["device"] is not None:
        device_lib.set_device_rng_state(state["device"], device)
    for name, gen_state in state["registered"].items():
        if name in _registered:
            _registered[name].set_state(gen_state)


@contextmanager
def preserved_global_rng(device: torch.device) -> Iterator[None]:
    """Run a block (validation, sampling, logging) without moving any training stream (DESIGN trap 6)."""
    saved = capture_global_rng(device)
    try:
        yield
    finally:
        restore_global_rng(saved, device)


def fingerprint(value: Any) -> str:
    """A short stable hash of a stream state (tensors, numbers, nested dicts) for logs and diagnosis."""
    hasher = hashlib.blake2b(digest_size=6)

    def feed(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            hasher.update(item.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(item, dict):
            for key in sorted(item):
                hasher.update(str(key).encode())
                feed(item[key])
        elif isinstance(item, (list, tuple)):
            for sub in item:
                feed(sub)
        else:
            hasher.update(repr(item).encode())

    feed(value)
    return hasher.hexdigest()
