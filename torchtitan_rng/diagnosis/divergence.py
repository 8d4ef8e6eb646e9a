"""Which random stream diverged first, and on which rank: read from the fingerprints in two loss logs.

Each loss-log line of a run with ``debug.rng_fingerprint`` holds, per rank, a hash of every random stream
entering that step (see fingerprints.py). Comparing two runs step by step, the first step where a hash
differs names the stream and rank that went wrong, and whether that happened before the losses parted or
not at all (then the difference is not in the random streams). Its hints say what a resume can have got wrong
only where a run resumed: two runs that differ from their first step were seeded or launched differently, and
the keys in which their configs differ are named where the runs recorded them (tensor_fingerprints.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchtitan_rng.config import RNG_STREAMS

FINGERPRINT_KEY = "rng_fingerprint"
ADVICE = "run both with --debug.rng_fingerprint to learn which random stream diverged first, and on which rank"

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

    def drawing(self) -> dict[int, list[str]]:
        """Per rank, the differing streams that random draws come from (the data position is not one)."""
        ranks: dict[int, list[str]] = {}
        for rank, stream, _, _ in self.differences:
            if stream != "dataloader":
                ranks.setdefault(rank, []).append(stream)
        return ranks


@dataclass
class Launches:
    """What the runs' records say about how they were launched up to a step (None: not recorded)."""
    resumed: bool | None = None  # whether either run started a process there after step 1 (a resume)
    configs: list[str] | None = None  # the keys (and the process count) in which their configs differ there


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


def describe(divergence: StreamDivergence, a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]],
             launches: Launches | None = None) -> list[str]:
    """Lines for a person: the step, then each differing stream and rank with both fingerprints, and where
    one run's state shows up in the other's history (a reseed, or a stream a few draws behind or ahead); the
    hints assume a resume only where one may have happened (``launches``: what the runs recorded)."""
    lines = [f"random streams first differ entering step {divergence.step}:"]
    for rank, stream, print_a, print_b in divergence.differences:
        line = f"  stream {stream} on rank {rank} (A {print_a}, B {print_b})"
        if (in_a := _seen_at(a, rank, stream, print_b)) is not None:
            line += f": B holds the state A had entering step {in_a}"
        elif (in_b := _seen_at(b, rank, stream, print_a)) is not None:
            line += f": A holds the state B had entering step {in_b}"
        lines.append(line)
    launches = launches or Launches()
    if divergence.step == 1 or launches.resumed is False:
        lines.append(f"  hint: {_unresumed_hint(divergence.step, a, b, launches.configs)}")
        return lines
    kinds = {"dataloader" if stream == "dataloader" else "global" for _, stream, _, _ in divergence.differences}
    lines.extend(f"  hint: {_HINTS[kind]}" for kind in sorted(kinds))
    return lines


def _unresumed_hint(step: int, a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]],
                    configs: list[str] | None) -> str:
    """Neither run restored anything before ``step``: what differs is how they were launched, or what drew."""
    if configs is None:  # not recorded: the process counts are in the fingerprints themselves
        sizes = [len(run[step][FINGERPRINT_KEY]) for run in (a, b)]
        configs = [f"the process count {sizes[0]} vs {sizes[1]}"] if sizes[0] != sizes[1] else None
    if step == 1:
        said = ("neither run had resumed entering step 1, so nothing was restored: they were seeded or launched "
                "differently")
    else:
        said = (f"neither run resumed up to step {step}: something drew from the stream a different number of times "
                "before it (randomness outside the training step, or a rank-dependent code path)")
    if configs:
        return f"{said}; their configs differ: {', '.join(configs)}"
    if configs is None and step == 1:
        return (f"{said} (debug.seed? the process count? --debug.tensor_fingerprint records each run's config and "
                "names the keys that differ)")
    return said


def diagnose(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], first_loss_step: int,
             launches: Launches | None = None, advice: str = ADVICE) -> list[str]:
    """Why the losses of A and B part at ``first_loss_step``, as far as the fingerprints tell; ``advice``: what
    to run where a log has none (the trainer that wrote them decides what works)."""
    missing = [name for name, records in (("A", a), ("B", b)) if not has_fingerprints(records)]
    if missing:
        return [f"no RNG fingerprints in {' and '.join(missing)}: {advice}"]
    divergence = first_stream_divergence(a, b, up_to=first_loss_step)
    if divergence is None:
        return [f"every random stream matched on every rank entering step {first_loss_step}: the difference "
                "is elsewhere (model/optimizer/lr state, the data itself, or nondeterministic kernels: try "
                "--debug.deterministic)"]
    return describe(divergence, a, b, launches)
