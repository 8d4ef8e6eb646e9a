"""Every random stream of a run, in one place.

Two kinds of stream (the reasoning: docs/design.md, "Where randomness lives"):

* Global streams, captured per rank at a step boundary and restored last before the first resumed step:
  Python ``random``, NumPy's global RNG, torch's CPU generator, this rank's device generator (through
  ``device.py``), and generators registered by name with :func:`register_generator`.
* Derived streams: a generator seeded from ``(root seed, purpose, keys...)`` by :func:`derive_seed`. They do
  not depend on worker count, prefetching or what ran before, so they resume exactly with no saved state.

Every derived stream of this project is a row of ``STREAMS`` below (purpose, root seed, shared or per
rank, what it feeds) and is drawn by its purpose with :func:`stream_seed`, :func:`stream_generator` or
:func:`frozen_generator`; an unknown purpose is an error. The root is the run's seed (``debug.seed``) or
``FROZEN_SEED`` for what must not change with the seed. docs/randomness.md shows the same table (a test keeps
them equal). A user's own purposes (``SampleRandomDataset(seed, "my-purpose")``, :func:`derived_generator`)
are free-form and need no row.
"""

from __future__ import annotations

import hashlib
import random
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from torchtitan_rng import device as device_lib

# The root of streams that must be the same in every run whatever ``debug.seed`` is (frozen encoders, the
# synthetic data's content); changing it changes every such stream.
FROZEN_SEED = 20240801


@dataclass(frozen=True)
class Stream:
    """One row of the table: a derived stream's purpose and where its numbers go."""

    purpose: str
    root: str  # "run": the run's seed; "frozen": FROZEN_SEED
    scope: str  # "shared", "per rank", "per stream" (a rank's or worker's share of a stream) or "per sample"
    keys: tuple[str, ...]  # what follows the purpose in derive_seed, in order
    feeds: str


STREAMS: dict[str, Stream] = {
    stream.purpose: stream
    for stream in (
        Stream("model-init", "run", "shared", (), "the global torch generator while the model is built: "
               "identical initial weights on every rank"),
        Stream("training-streams", "run", "per rank", ("rank",), "the global streams of a fresh run (dropout, "
               "Flux noise, timesteps and prompt dropout); rank: the data shard and stage, so the ranks of a "
               "tensor-parallel group draw alike"),
        Stream("micro-batch", "run", "per micro-batch", ("step", "slot"), "world-size-invariant training: the "
               "global streams and registered generators before each micro-batch, the same at any process count"),
        Stream("micro-batch-layer", "run", "per micro-batch", ("step", "slot", "layer"), "world-size-invariant "
               "training: the same streams again before each block (layer) of a micro-batch, so that a pipeline "
               "stage starting at any layer draws what one process running every layer draws"),
        Stream("tensor-chunk", "run", "per micro-batch", ("block draw", "chunk"), "world-size-invariant training "
               "with tensor chunks: the torch streams while one chunk of a split layer draws (attention dropout), keyed "
               "by a number its block's stream draws first, so that the rank holding the chunk draws what one process "
               "draws for it"),
        Stream("reseed", "run", "per rank", ("step",), "a resume that cannot restore the global streams (no RNG "
               "state, another process count or device type): the root of its fresh training-streams"),
        Stream("dataloader", "run", "per rank", ("dp_rank",), "the dataloader's own generator: its workers' base "
               "seeds"),
        Stream("sampler", "run", "shared", ("epoch",), "the epoch's permutation of the samples (each rank takes "
               "its share)"),
        Stream("llm-window", "run", "per sample", ("sample key",), "the Llama dataset's random window offset"),
        Stream("stream-shuffle", "run", "per stream", ("stream", "epoch"), "the streaming source's draws from its "
               "shuffle buffer (one stream per rank and worker)"),
        Stream("flux-augment", "run", "per sample", ("sample key",), "the Flux dataset's crop, flip and caption "
               "template"),
        Stream("flux-validation", "run", "shared", (), "the Flux validation batch's noise, timesteps and "
               "sampling start"),
        Stream("flux-content", "frozen", "shared", ("index",), "the Flux dataset's scenes (fixed data, like a "
               "dataset on disk)"),
        Stream("flux-autoencoder", "frozen", "shared", (), "the frozen Flux autoencoder's channel mix"),
        Stream("flux-t5", "frozen", "shared", (), "the frozen T5-like text encoder's weights"),
        Stream("flux-clip", "frozen", "shared", (), "the frozen CLIP-like text encoder's weights"),
    )
}


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


def _row(purpose: str, root: str) -> Stream:
    """The table's row for ``purpose``; a ValueError naming the table when there is none or its root differs."""
    stream = STREAMS.get(purpose)
    if stream is None:
        raise ValueError(f"{purpose!r} is not a random-stream purpose of this project; add a row to STREAMS in "
                         f"torchtitan_rng/rng.py (known: {', '.join(STREAMS)})")
    if stream.root != root:
        drawn_by = "stream_seed or stream_generator" if stream.root == "run" else "frozen_generator"
        raise ValueError(f"random stream {purpose!r} has the {stream.root} root: draw it with {drawn_by}")
    return stream


def _checked_keys(stream: Stream, keys: tuple[int | str, ...]) -> tuple[int | str, ...]:
    if len(keys) != len(stream.keys):
        wanted = ", ".join(stream.keys) or "no keys"
        raise ValueError(f"random stream {stream.purpose!r} takes {wanted}; got {len(keys)} key(s)")
    return keys


def stream_seed(purpose: str, seed: int, *keys: int | str) -> int:
    """The seed of the run-rooted stream ``purpose`` of the table: ``derive_seed(seed, purpose, *keys)``."""
    return derive_seed(seed, purpose, *_checked_keys(_row(purpose, "run"), keys))


def stream_generator(purpose: str, seed: int, *keys: int | str,
                     device: str | torch.device = "cpu") -> torch.Generator:
    """A torch generator seeded with :func:`stream_seed`."""
    return torch.Generator(device=device).manual_seed(stream_seed(purpose, seed, *keys))


def frozen_generator(purpose: str, *keys: int | str) -> torch.Generator:
    """A CPU generator for a frozen-rooted stream of the table: the same in every run, whatever the seed."""
    keys = _checked_keys(_row(purpose, "frozen"), keys)
    return torch.Generator().manual_seed(derive_seed(FROZEN_SEED, purpose, *keys))


def sample_purpose(purpose: str) -> str:
    """``purpose`` once checked to be a per-sample row of the table: what a project dataset passes to
    ``SampleRandomDataset``, whose per-sample generators are ``derive_seed(seed, purpose, key)``."""
    if _row(purpose, "run").scope != "per sample":
        raise ValueError(f"random stream {purpose!r} is not drawn per sample: draw it with stream_generator")
    return purpose


_registered: dict[str, torch.Generator] = {}


def register_generator(name: str, generator: torch.Generator) -> None:
    """Make ``generator`` part of the captured global streams (saved and restored with the checkpoint)."""
    _registered[name] = generator


def registered_generators() -> dict[str, torch.Generator]:
    return dict(_registered)


def seed_model_init(seed: int) -> None:
    """Shared across ranks: every rank builds the same initial weights."""
    device_lib.seed_generators(stream_seed("model-init", seed))


def seed_training_streams(seed: int, rank: int) -> None:
    """Per rank: the global streams a fresh run trains with (a resumed run restores them instead). The trainer
    passes its plan's ``stream_rank`` (the data shard and stage): the ranks of a tensor-parallel group alike."""
    _seed_global_streams(stream_seed("training-streams", seed, rank))


def seed_micro_batch_streams(seed: int, step: int, slot: int) -> None:
    """World-size-invariant training: the global and registered streams of micro-batch ``slot`` of ``step``."""
    _seed_global_and_registered(stream_seed("micro-batch", seed, step, slot))


def seed_layer_streams(seed: int, step: int, slot: int, layer: int) -> None:
    """World-size-invariant training: the global and registered streams of block ``layer`` of micro-batch
    ``slot`` of ``step``, whichever process or pipeline stage runs that block."""
    _seed_global_and_registered(stream_seed("micro-batch-layer", seed, step, slot, layer))


def _seed_global_and_registered(value: int) -> None:
    _seed_global_streams(value)
    for name, generator in _registered.items():
        generator.manual_seed(derive_seed(value, "registered", name))


def _seed_global_streams(value: int) -> None:
    random.seed(value)
    np.random.seed(value % (1 << 32))
    device_lib.seed_generators(value)


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
    """Run a block (validation, sampling, logging) without moving any training stream (docs/design.md, "Validation forks the streams")."""
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


# The streams a group of ranks that draw alike draws its dropout masks from: torch's CPU generator (DTensor's
# random ops on a CPU mesh, and every op on a plain tensor there) and the accelerator's (which DTensor's random ops
# offset). Equal on every rank of the group while its ranks draw alike; Python's and NumPy's streams draw no masks.
MASK_STREAMS = ("torch_cpu", "device")
# Each kind of group whose ranks must draw alike, and what ranks of it with different mask streams do.
MASK_GROUPS = {"tensor-parallel": "a dropout in a region they replicate draws another mask on each rank",
               "context-parallel": "the ranks draw their slices of one sequence's masks from different points",
               "replicate (HSDP)": "the replicas no longer draw as each other"}


def mask_group_mismatch(step: int, ranks: list[int], streams: list[dict[str, str]],
                        group: str = "tensor-parallel") -> str | None:
    """The WARNING line when the ranks of one ``group`` (a kind of ``MASK_GROUPS``; ``ranks``, with the
    fingerprints of their ``MASK_STREAMS``) hold different mask streams at a save; None when they are the same."""
    differing = [name for name in MASK_STREAMS if len({rank_streams[name] for rank_streams in streams}) > 1]
    if not differing:
        return None
    holders = "; ".join(f"rank {rank}: " + ", ".join(rank_streams[name] for name in differing)
                        for rank, rank_streams in zip(ranks, streams))
    return (f"at step {step} the ranks of a {group} group hold different {' and '.join(differing)} random streams "
            f"({holders}): {MASK_GROUPS[group]}; each rank's streams are saved as they are, so the resume stays "
            "exact")


def group_mask_streams(step: int, group: Any, device: torch.device,
                       kind: str = "tensor-parallel") -> tuple[list[int], str | None]:
    """Every rank of ``group``, a group of the ``kind`` (of ``MASK_GROUPS``) (a collective): the group's ranks and
    :func:`mask_group_mismatch`'s line for their mask streams as they stand now."""
    import torch.distributed as dist

    state = capture_global_rng(device)
    mine = {name: fingerprint(state[name]) for name in MASK_STREAMS}
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    ranks = dist.get_process_group_ranks(group)
    return ranks, mask_group_mismatch(step, ranks, gathered, kind)
