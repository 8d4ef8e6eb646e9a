"""What the debug options do at each step boundary: fingerprint every random stream (debug.rng_fingerprint)
and, for testing a diagnosis, disturb one of them (debug.perturb_rng).

The fingerprints are taken entering a step, before its batch is fetched: for the first step of a resumed
run that is the state just restored, so a comparison with an uninterrupted run says whether the restore
was exact, stream by stream and rank by rank. Every rank's fingerprints are gathered to rank 0 (one
collective per step, only when the option is on) and written into its loss-log line as
``"rng_fingerprint": [{stream: hash} for each rank]``.

Where the run's parallel plan carries no stream from step to step (every micro-batch seeds them from
``(seed, step, slot)``), the streams are fingerprinted as this rank's first
micro-batch of the step will have them (``plan.step_streams``), and the data as what carries its position
there (``plan.data_position``: the batch sampler; the rest of the loader's state is not restored in that mode).
"""

from __future__ import annotations

import random
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

from torchtitan_rng.checkpoint.states import Stateful
from torchtitan_rng.config import ConfigError, Debug, parse_perturb_rng
from torchtitan_rng.diagnosis.divergence import FINGERPRINT_KEY
from torchtitan_rng.parallel.plan import ParallelPlan
from torchtitan_rng.rng import capture_global_rng, fingerprint, registered_generators


def stream_fingerprints(device: torch.device, data_position: Stateful) -> dict[str, str]:
    """A short hash of each random stream of this rank, as it stands now (drawing nothing from any), and of what
    carries its data position (the sampler position, worker seeds and whatever else the loader carries)."""
    prints = _global_stream_prints(device)
    prints["dataloader"] = fingerprint(data_position.state_dict())
    return prints


def _global_stream_prints(device: torch.device) -> dict[str, str]:
    state = capture_global_rng(device)
    prints = {name: fingerprint(state[name]) for name in ("python", "numpy", "torch_cpu")}
    if state["device"] is not None:  # on the CPU the device stream is torch_cpu
        prints["device"] = fingerprint(state["device"])
    for name, gen_state in state["registered"].items():
        prints[f"registered.{name}"] = fingerprint(gen_state)
    return prints


def _gather(prints: dict[str, str]) -> list[dict[str, str]]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [prints]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, prints)
    return gathered


class StreamProbe:
    """Called entering every step; costs one ``if`` per step when both options are off."""

    def __init__(self, debug: Debug, plan: ParallelPlan, *, rank: int, world_size: int,
                 dataloader: Stateful) -> None:
        """``plan``: how the run's streams enter a step (carried, or seeded by each micro-batch)."""
        self.enabled = debug.rng_fingerprint
        self.rank = rank
        self.plan = plan
        self.device = plan.world.device
        self.data_position = plan.data_position(dataloader)
        self.perturb: tuple[str, int, int] | None = None
        if debug.perturb_rng:
            stream, perturb_rank, step = parse_perturb_rng(debug.perturb_rng)
            _check_stream_exists(stream, perturb_rank, world_size, self.device)
            if not plan.carries_streams and stream != "dataloader":
                raise ConfigError(f"config debug.perturb_rng disturbs the {stream} stream entering a step, but in this "
                                  "run every micro-batch seeds the streams anew, so it would change nothing; perturb "
                                  "the dataloader instead")
            self.perturb = (stream, perturb_rank, step)

    def at_boundary(self, step: int, data_iter: Iterator[Any]) -> dict[str, Any]:
        """Entering ``step``: the fields for its loss-log line (on rank 0; ``{}`` elsewhere or when off)."""
        if self.perturb is not None and self.perturb[1:] == (self.rank, step):
            _disturb(self.perturb[0], self.device, data_iter)
        if not self.enabled:
            return {}
        with self.plan.step_streams(step):
            prints = stream_fingerprints(self.device, self.data_position)
        gathered = _gather(prints)
        return {FINGERPRINT_KEY: gathered} if self.rank == 0 else {}


def _check_stream_exists(stream: str, rank: int, world_size: int, device: torch.device) -> None:
    if rank >= world_size:
        raise ConfigError(f"config debug.perturb_rng names rank {rank}, but this run has ranks 0..{world_size - 1}")
    if stream == "device" and device.type == "cpu":
        raise ConfigError("config debug.perturb_rng names the device stream, but this run is on the CPU "
                          "(its device stream is torch_cpu)")
    if stream.startswith("registered.") and stream[len("registered."):] not in registered_generators():
        known = ", ".join(sorted(registered_generators())) or "none"
        raise ConfigError(f"config debug.perturb_rng names {stream!r}, which this run does not register "
                          f"(registered generators: {known})")


def _disturb(stream: str, device: torch.device, data_iter: Iterator[Any]) -> None:
    """One extra draw from the stream (for the dataloader: one skipped batch), as a real bug would do."""
    if stream == "python":
        random.random()
    elif stream == "numpy":
        np.random.random()
    elif stream == "torch_cpu":
        torch.rand(1)
    elif stream == "device":
        torch.rand(1, device=device)
    elif stream == "dataloader":
        next(data_iter)
    else:
        generator = registered_generators()[stream[len("registered."):]]
        torch.rand(1, generator=generator, device=generator.device)
