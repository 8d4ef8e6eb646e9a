"""Which tensor parted first: two runs' tensor fingerprints (``debug.tensor_fingerprint``) read step by step.

At each step both runs hold, in the order a step makes them: the state entering it where a process started
there (a resume loads it), the batch of each micro-batch, the module calls (at ``debug.fingerprint_modules_at_step``),
the gradients before clipping, then the parameters and the optimizer state after the update. The first of these
that differs, rank by rank, is named in plain words with what it implies (the data, a kernel, the optimizer).

Two runs over other process counts are compared as whole steps: the samples of a step as a set, each sharded
tensor as the sum of its shards' hashes (see tensor_fingerprints.py); modules are then not compared. Reading
imports no torch: compare_losses stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from torchtitan_rng.diagnosis.fingerprint_files import Steps, read_rank_files

FOLDER = "tensor_fingerprints"  # in the dump folder: one file per rank (written by tensor_fingerprints.py)
# A hash wraps at 2**32 (2**64 for 64-bit elements): shards add up to the whole modulo 2**32 in either case.
_WRAP = 2**32


@dataclass
class RunPrints:
    steps: Steps
    sharded: set[str]

    def ranks(self, step: int) -> list[dict[str, Any]]:
        """The lines of ``step``, one per rank of the process count that trained it (rank 0 says how many)."""
        lines = self.steps[step]
        return [lines[rank] for rank in sorted(lines) if rank < lines[0]["world_size"]]

    def entering(self, step: int, rank: int, kind: str) -> dict[str, int] | None:
        """``kind`` (param/optim) of ``rank`` as it entered ``step``: loaded there by a starting process, else left
        by the step before; None when neither was written."""
        line = self.steps.get(step, {}).get(rank, {})
        if "entering" in line:
            return line["entering"][kind]
        before = self.steps.get(step - 1, {}).get(rank)
        return before.get(kind) if before is not None else None


def prints_path(dump_folder: str | Path, rank: int) -> Path:
    return Path(dump_folder) / FOLDER / f"rank{rank}.jsonl"


def prints_folder(run: Path) -> Path:
    """The fingerprint folder of a run given as its dump folder or its loss_log.jsonl."""
    return (run if run.is_dir() else run.parent) / FOLDER


def read_prints(run: Path) -> RunPrints | None:
    """The run's fingerprints; None when it was trained without ``debug.tensor_fingerprint``."""
    read = read_rank_files(prints_folder(run))
    if read is None:
        return None
    steps, sharded = read
    return RunPrints({step: lines for step, lines in steps.items() if 0 in lines}, sharded)


@dataclass
class Finding:
    step: int
    lines: list[str]


def _first_key(a: dict[str, int], b: dict[str, int]) -> str | None:
    """The first name (in A's order, then B's) whose hash differs or that only one side holds."""
    for name in [*a, *(name for name in b if name not in a)]:
        if a.get(name) != b.get(name):
            return name
    return None


def _whole(lines: list[dict[str, int] | None], sharded: set[str]) -> dict[str, int]:
    """Per name, the whole tensor's hash from every rank's: the shards' sum, or (replicated) rank 0's."""
    whole: dict[str, int] = {}
    for rank, prints in enumerate(lines):
        for name, value in (prints or {}).items():
            if name in sharded:
                whole[name] = (whole.get(name, 0) + value) % _WRAP
            elif rank == 0:
                whole[name] = value % _WRAP
    return whole


class _Step:
    """One step of both runs, checked in the order the step makes its tensors."""

    def __init__(self, a: RunPrints, b: RunPrints, step: int) -> None:
        self.a, self.b, self.step = a, b, step
        self.lines_a, self.lines_b = a.ranks(step), b.ranks(step)
        self.same_ranks = len(self.lines_a) == len(self.lines_b)

    def _at(self, rank: int | None) -> str:
        return f"step {self.step}" + (f", rank {rank}" if rank is not None and self.same_ranks else "")

    def _per_rank(self, get_a: Callable[[int], dict[str, int] | None],
                  get_b: Callable[[int], dict[str, int] | None]) -> tuple[int | None, str] | None:
        """(rank or None, the first differing name) over ranks (same process count) or whole tensors."""
        if self.same_ranks:
            for rank in range(len(self.lines_a)):
                prints_a, prints_b = get_a(rank), get_b(rank)
                if prints_a is None or prints_b is None:
                    continue
                if (name := _first_key(prints_a, prints_b)) is not None:
                    return rank, name
            return None
        ranks_a, ranks_b = [get_a(r) for r in range(len(self.lines_a))], [get_b(r) for r in range(len(self.lines_b))]
        if any(prints is None for prints in ranks_a + ranks_b):
            return None
        name = _first_key(_whole(ranks_a, self.a.sharded), _whole(ranks_b, self.b.sharded))
        return (None, name) if name is not None else None

    def entering(self) -> list[str] | None:
        starts = any("entering" in line for line in self.lines_a + self.lines_b)
        if not starts:
            return None  # the state entering this step is the one the step before left, compared there
        for kind in ("param", "optim"):
            found = self._per_rank(lambda r: self.a.entering(self.step, r, kind),
                                   lambda r: self.b.entering(self.step, r, kind))
            if found is not None:
                rank, name = found
                what = "parameter" if kind == "param" else "optimizer state"
                resumed = [label for label, lines in (("A", self.lines_a), ("B", self.lines_b))
                           if any("entering" in line for line in lines) and self.step > 1]
                how = (f"{' and '.join(resumed)} resumed here: what the resume loaded differs"
                       if resumed else "the initial weights differ")
                return [f"{self._at(rank)}: {what} `{name}` entering the step differs, before any batch "
                        f"({how}: the checkpoint or its loading, not this step's training)"]
        return None

    def data(self) -> list[str] | None:
        if not self.same_ranks:
            samples_a, samples_b = _samples(self.lines_a), _samples(self.lines_b)
            if samples_a != samples_b:
                return [f"step {self.step}: the samples of the step differ (as a set over every rank and micro-batch,"
                        f" {len(self.lines_a)} against {len(self.lines_b)} processes): the data, not the model"]
            return None
        for rank, (line_a, line_b) in enumerate(zip(self.lines_a, self.lines_b)):
            batches_a, batches_b = line_a.get("batch", []), line_b.get("batch", [])
            for index in range(max(len(batches_a), len(batches_b))):
                batch_a = batches_a[index] if index < len(batches_a) else None
                batch_b = batches_b[index] if index < len(batches_b) else None
                if batch_a == batch_b:
                    continue
                if batch_a is None or batch_b is None:
                    return [f"{self._at(rank)}: {'A' if batch_b is None else 'B'} took micro-batch {index} and the "
                            "other did not (another number of micro-batches per step: the data, not the model)"]
                key = next(key for key in [*batch_a, *batch_b] if batch_a.get(key) != batch_b.get(key))
                rows = _differing_rows(batch_a.get(key, []), batch_b.get(key, []))
                return [f"{self._at(rank)}: the batch of micro-batch {index} differs (`{key}`, sample(s) "
                        f"{rows} of it): the data, not the model"]
        return None

    def modules(self) -> list[str] | None:
        if not self.same_ranks:
            return None
        first: tuple[int, int, str] | None = None  # (call index, rank, sentence)
        for rank, (line_a, line_b) in enumerate(zip(self.lines_a, self.lines_b)):
            calls_a, calls_b = line_a.get("modules"), line_b.get("modules")
            if calls_a is None or calls_b is None:
                continue
            for index, (call_a, call_b) in enumerate(zip(calls_a, calls_b)):
                if first is not None and index >= first[0]:
                    break
                sentence = _call_difference(call_a, call_b)
                if sentence is not None:
                    first = (index, rank, sentence)
                    break
            else:
                if len(calls_a) != len(calls_b) and (first is None or min(len(calls_a), len(calls_b)) < first[0]):
                    first = (min(len(calls_a), len(calls_b)), rank, "the modules ran another number of times "
                             f"(A {len(calls_a)} calls, B {len(calls_b)}): another model or schedule")
        if first is None:
            return None
        return [f"{self._at(first[1])}: {first[2]}"]

    def gradients(self) -> list[str] | None:
        found = self._per_rank(lambda r: self.lines_a[r].get("grad"), lambda r: self.lines_b[r].get("grad"))
        if found is None:
            return None
        rank, name = found
        if self.same_ranks and any("modules" in line for line in self.lines_a):
            seen = "the batches equal, every module's output equal"
            cause = ("the backward pass: a non-deterministic kernel (try --debug.deterministic), or the gradients' "
                     "reduction over the ranks")
        elif self.same_ranks:
            seen = "the batches and the weights entering the step equal"
            cause = ("the step's computation: its random draws (dropout: --debug.rng_fingerprint tells), a "
                     "non-deterministic kernel (--debug.fingerprint_modules_at_step "
                     f"{self.step} names the module), or the gradients' reduction over the ranks")
        else:
            cause = (f"summed over {len(self.lines_a)} against {len(self.lines_b)} processes: another reduction "
                     "order (and each rank's own random draws), which is expected outside the world-size-invariant "
                     "mode")
            seen = "the same samples"
        return [f"{self._at(rank)}: gradient of `{name}` differs before clipping, {seen}: {cause}"]

    def update(self) -> list[str] | None:
        for kind in ("param", "optim"):
            found = self._per_rank(lambda r: self.lines_a[r].get(kind), lambda r: self.lines_b[r].get(kind))
            if found is None:
                continue
            rank, name = found
            everywhere = "on every rank" if self.same_ranks and len(self.lines_a) > 1 else ""
            equal = " ".join(filter(None, ("gradients equal", everywhere)))
            if kind == "param":
                return [f"{self._at(rank)}: {equal}, parameter `{name}` after the update differs (the optimizer: "
                        "its state or its hyperparameters, e.g. the learning rate)"]
            return [f"{self._at(rank)}: {equal}, parameters after the update equal, optimizer state `{name}` "
                    "differs (the optimizer's state: what it carries to the next step)"]
        return None


def _samples(lines: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Per batch entry, the hashes of every sample of the step on every rank, sorted (a set with repeats)."""
    samples: dict[str, list[int]] = {}
    for line in lines:
        for batch in line.get("batch", []):
            for key, rows in batch.items():
                samples.setdefault(key, []).extend(rows)
    return {key: sorted(rows) for key, rows in samples.items()}


def _differing_rows(a: list[int], b: list[int]) -> str:
    rows = [index for index in range(max(len(a), len(b)))
            if (a[index] if index < len(a) else None) != (b[index] if index < len(b) else None)]
    return ", ".join(map(str, rows[:8])) + (", ..." if len(rows) > 8 else "")


def _call_difference(call_a: list[Any], call_b: list[Any]) -> str | None:
    name_a, inputs_a, outputs_a = call_a
    name_b, inputs_b, outputs_b = call_b
    if name_a != name_b:
        return f"the modules ran in another order (A called `{name_a}` where B called `{name_b}`): another model"
    if inputs_a != inputs_b:
        return (f"`{name_a}` input differs, every module call that ended before it gave equal outputs: the "
                "difference arose outside any module (code between modules, or the step's input)")
    if outputs_a != outputs_b:
        return (f"`{name_a}` output differs, its input equal (a kernel: an operation inside it gave other bits; "
                "its parameters entered the step equal)")
    return None


def locate(a: RunPrints, b: RunPrints, up_to: int | None = None) -> Finding | None:
    """The first thing that differs, up to step ``up_to``, in the order entering state, data, forward, gradient,
    update; None when every fingerprint both runs hold is equal."""
    for step in sorted(set(a.steps) & set(b.steps)):
        if up_to is not None and step > up_to:
            break
        checks = _Step(a, b, step)
        for check in (checks.entering, checks.data, checks.modules, checks.gradients, checks.update):
            lines = check()
            if lines is not None:
                return Finding(step, lines)
    return None


def locate_runs(run_a: Path, run_b: Path, up_to: int | None = None) -> tuple[str, list[str]]:
    """("found", lines) naming the first difference; ("equal", lines) when every fingerprint matched; ("absent",
    lines) when one run has none (a hint), or ("absent", []) when neither has any (nothing to say)."""
    a, b = read_prints(run_a), read_prints(run_b)
    if a is None and b is None:
        return "absent", []
    if a is None or b is None:
        return "absent", [f"tensor fingerprints only in {'B' if a is None else 'A'}: run both with "
                          "--debug.tensor_fingerprint to learn which tensor differed first"]
    finding = locate(a, b, up_to)
    if finding is None:
        span = f"up to step {up_to}" if up_to is not None else "at every step both hold"
        return "equal", [f"every tensor fingerprint equal {span} (batches, gradients, parameters, optimizer state)"]
    return "found", ["the first tensor that differs: " + finding.lines[0], *finding.lines[1:]]


def tensor_report(run_a: Path, run_b: Path, first_loss_step: int | None) -> list[str]:
    """Lines for compare_losses: where the losses part at ``first_loss_step``, the first tensor that differs up to
    it; where they do not (None), a note only when a tensor differs all the same."""
    state, lines = locate_runs(run_a, run_b, first_loss_step)
    if first_loss_step is not None:
        return lines
    return ["note: the losses are equal, but " + lines[0], *lines[1:]] if state == "found" else []
