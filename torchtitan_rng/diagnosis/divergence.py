"""Which random stream diverged first, and on which rank: read from the fingerprints in two loss logs.

Each loss-log line of a run with ``debug.rng_fingerprint`` holds, per rank, a hash of every random stream
entering that step (see fingerprints.py). Comparing two runs step by step, the first step where a hash
differs names the stream and rank that went wrong, and whether that happened before the losses parted or
not at all (then the difference is not in the random streams).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchtitan_rng.config import RNG_STREAMS

FINGERPRINT_KEY = "rng_fingerprint"

_HINTS = {
    "dataloader": "the data position or worker state differs (the dataloader part of the checkpoint?)",
    "global": "a global stream was not restored exactly, or something drew from it a different number of "
              "times before this step (checkpoint.restore_rng? randomness outside the training step?)",
}


@dataclass
class StreamDivergence:
    step: int
    # (rank, stream, fingerprint in A, fingerprint in B); a stream absent from one run shows as "-".
    differences: list[tuple[int, str, str, str]]


def _stream_order(name: str) -> tuple[int, str]:
    # The built-in streams in their usual order, then registered generators by name.
    return (RNG_STREAMS.index(name), "") if name in RNG_STREAMS else (len(RNG_STREAMS), name)


def _differences(a: list[dict[str, str]], b: list[dict[str, str]]) -> list[tuple[int, str, str, str]]:
    found = []
    for rank in range(max(len(a), len(b))):
        prints_a = a[rank] if rank < len(a) else {}
        prints_b = b[rank] if rank < len(b) else {}
        for stream in sorted(set(prints_a) | set(prints_b), key=_stream_order):
            if prints_a.get(stream) != prints_b.get(stream):
                found.append((rank, stream, prints_a.get(stream, "-"), prints_b.get(stream, "-")))
    return found


def has_fingerprints(records: dict[int, dict[str, Any]]) -> bool:
    return any(FINGERPRINT_KEY in record for record in records.values())


def first_stream_divergence(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]],
                            up_to: int | None = None) -> StreamDivergence | None:
    """The first step (up to ``up_to``) held by both logs, with fingerprints in both, where any differs."""
    for step in sorted(set(a) & set(b)):
        if up_to is not None and step > up_to:
            break
        prints_a, prints_b = a[step].get(FINGERPRINT_KEY), b[step].get(FINGERPRINT_KEY)
        if prints_a is None or prints_b is None:
            continue
        differences = _differences(prints_a, prints_b)
        if differences:
            return StreamDivergence(step, differences)
    return None


def _seen_at(records: dict[int, dict[str, Any]], rank: int, stream: str, value: str) -> int | None:
    """The first step entering which ``records`` had this fingerprint for (rank, stream)."""
    for step in sorted(records):
        prints = records[step].get(FINGERPRINT_KEY)
        if prints is not None and rank < len(prints) and prints[rank].get(stream) == value:
            return step
    return None


def describe(divergence: StreamDivergence, a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> list[str]:
    """Lines for a person: the step, then each differing stream and rank with both fingerprints, and where
    one run's state shows up in the other's history (a reseed, or a stream a few draws behind or ahead)."""
    lines = [f"random streams first differ entering step {divergence.step}:"]
    for rank, stream, print_a, print_b in divergence.differences:
        line = f"  stream {stream} on rank {rank} (A {print_a}, B {print_b})"
        if (in_a := _seen_at(a, rank, stream, print_b)) is not None:
            line += f": B holds the state A had entering step {in_a}"
        elif (in_b := _seen_at(b, rank, stream, print_a)) is not None:
            line += f": A holds the state B had entering step {in_b}"
        lines.append(line)
    kinds = {"dataloader" if stream == "dataloader" else "global" for _, stream, _, _ in divergence.differences}
    lines.extend(f"  hint: {_HINTS[kind]}" for kind in sorted(kinds))
    return lines


def diagnose(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], first_loss_step: int) -> list[str]:
    """Why the losses of A and B part at ``first_loss_step``, as far as the fingerprints tell."""
    missing = [name for name, records in (("A", a), ("B", b)) if not has_fingerprints(records)]
    if missing:
        return [f"no RNG fingerprints in {' and '.join(missing)}: run both with --debug.rng_fingerprint "
                "to learn which random stream diverged first, and on which rank"]
    divergence = first_stream_divergence(a, b, up_to=first_loss_step)
    if divergence is None:
        return [f"every random stream matched on every rank entering step {first_loss_step}: the difference "
                "is elsewhere (model/optimizer/lr state, the data itself, or nondeterministic kernels: try "
                "--debug.deterministic)"]
    return describe(divergence, a, b)
