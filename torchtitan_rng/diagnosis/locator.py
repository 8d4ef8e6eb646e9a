"""Which tensor parted first: two runs' tensor fingerprints (``debug.tensor_fingerprint``) read step by step.

At each step both runs hold, in the order a step makes them: the state entering it where a process started
there (a resume loads it), the batch of each micro-batch, the module calls (at ``debug.fingerprint_modules_at_step``),
each rank's micro-batch losses (before any reduction over ranks), the gradients before clipping, then the
parameters after the update and, at the steps a run saved, its optimizer state. The first of these that differs,
rank by rank, is named in plain words with what it implies (the data, random draws, a kernel, the optimizer), with
the keys in which the two runs' configs differ where that is what the verdict turns on (each process records its
config).

Two runs over other process counts are compared as whole steps: the samples of a step as a set, each sharded
tensor as the sum of its shards' hashes (see tensor_fingerprints.py); modules and losses are then not compared.
Two runs that split a step into other micro-batches compare the samples of each rank as a set, and neither
modules nor losses. Reading imports no torch: compare_losses stays light.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from torchtitan_rng.diagnosis.divergence import Launches
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

    def starts(self) -> list[int]:
        """The steps where a process of this run started (its first line holds ``entering``)."""
        return sorted(step for step, lines in self.steps.items() if "entering" in lines[0])

    def config(self, step: int) -> tuple[int, dict[str, Any] | None]:
        """(the step where the process that trained ``step`` started, the config it recorded; None if none)."""
        start = max((start for start in self.starts() if start <= step), default=0)
        config = self.steps[start][0].get("config") if start else None
        return start, config if isinstance(config, dict) else None

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
    # Whether it is inside the step's computation (a module's output, a loss or a gradient differs, the batches
    # and the weights entering the step equal, the same split on the same ranks): what a replay can narrow down.
    in_computation: bool = False


@dataclass
class Draws:
    """What the random-stream diagnosis (divergence.py) found: the step entering which streams first differ,
    and per rank the streams that differ there (the data position excluded: that is data, not draws)."""
    step: int
    ranks: dict[int, list[str]]


def config_differences(a: RunPrints, b: RunPrints, step: int) -> list[str] | None:
    """The config keys (those that can change the losses) and the process count in which the processes that trained
    ``step`` differ, as recorded: ``debug.seed 0 vs 1``, or ``training.max_norm 1.0 → 0.5 (B's resume entering
    step 4)`` where one run changed the key at a resume from the other run's value. None where a run recorded no
    config and the process counts are equal (nothing known)."""
    (start_a, config_a), (start_b, config_b) = a.config(step), b.config(step)
    found = []
    if a.steps.get(step) and b.steps.get(step):
        sizes = (a.steps[step][0]["world_size"], b.steps[step][0]["world_size"])
        if sizes[0] != sizes[1]:
            found.append(f"the process count {sizes[0]} vs {sizes[1]}")
    if config_a is None or config_b is None:
        return found or None
    # Imported here: the record's module reads checksums with numpy, and compare_losses and verify_resume must
    # start (and say what is missing) under a Python that has neither numpy nor torch.
    from torchtitan_rng.checkpoint.run_record import is_quiet

    for key in sorted(set(config_a) | set(config_b)):
        value_a, value_b = config_a.get(key), config_b.get(key)
        if is_quiet(key) or value_a == value_b:
            continue
        for label, run, start, value, other in (("B", b, start_b, value_b, value_a),
                                                 ("A", a, start_a, value_a, value_b)):
            earlier = run.config(start - 1)[1] if start > 1 else None
            if earlier is not None and key in earlier and earlier[key] == other:
                found.append(f"{key} {json.dumps(other)} → {json.dumps(value)} ({label}'s resume entering step "
                             f"{start})")
                break
        else:
            found.append(f"{key} {json.dumps(value_a)} vs {json.dumps(value_b)}")
    return found


def resumed_by(a: RunPrints, b: RunPrints, step: int) -> bool:
    """Whether a process of either run started after step 1 and at or before ``step`` (a resume)."""
    return any(1 < start <= step for run in (a, b) for start in run.starts())


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


def recorded_outside_the_trainer(run: RunPrints) -> bool:
    """Whether ``run``'s fingerprints were recorded outside this project's trainer (ExactResume, the HF and
    Lightning integrations, the torchtitan plug-in: their config, unlike the trainer's, has no
    ``job.dump_folder``), where ``compare_losses --locate`` cannot replay a step."""
    config = run.config(min(run.steps))[1] if run.steps else None
    return config is not None and "job.dump_folder" not in config


class _Step:
    """One step of both runs, checked in the order the step makes its tensors."""

    def __init__(self, a: RunPrints, b: RunPrints, step: int, draws: Draws | None = None) -> None:
        self.a, self.b, self.step = a, b, step
        self.lines_a, self.lines_b = a.ranks(step), b.ranks(step)
        self.same_ranks = len(self.lines_a) == len(self.lines_b)
        # Per rank, the micro-batches x samples each run split its step into.
        self.splits = [(_split(line_a), _split(line_b)) for line_a, line_b in zip(self.lines_a, self.lines_b)]
        self.same_split = self.same_ranks and all(split_a == split_b for split_a, split_b in self.splits)
        self.draws = draws if draws is not None and draws.step <= step else None

    def _at(self, rank: int | None) -> str:
        return f"step {self.step}" + (f", rank {rank}" if rank is not None and self.same_ranks else "")

    def _modules_hint(self, what: str) -> str:
        """What looks at this step's module calls where the runs were trained, and ``what`` it does."""
        if recorded_outside_the_trainer(self.a) or recorded_outside_the_trainer(self.b):
            return f"rerun both with fingerprint_modules_at_step {self.step}: it {what}"
        return f"compare_losses --locate {what}"

    def _drawn(self, rank: int) -> str | None:
        """The random streams of ``rank`` the stream diagnosis named, as a clause; None where it named none."""
        if self.draws is None or rank not in self.draws.ranks:
            return None
        return (f"stream {', '.join(self.draws.ranks[rank])} on rank {rank} differs entering step {self.draws.step}, "
                "as named above")

    def _rank_order(self) -> list[int]:
        """The ranks, those whose streams the stream diagnosis named first: where a difference after a reduction
        over the ranks shows on every rank, it began there."""
        named = sorted(self.draws.ranks) if self.draws is not None else []
        return named + [rank for rank in range(len(self.lines_a)) if rank not in named]

    def _per_rank(self, get_a: Callable[[int], dict[str, int] | None],
                  get_b: Callable[[int], dict[str, int] | None]) -> tuple[int | None, str] | None:
        """(rank or None, the first differing name) over ranks (same process count) or whole tensors."""
        if self.same_ranks:
            for rank in self._rank_order():
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

    def _configs(self) -> list[str] | None:
        return config_differences(self.a, self.b, self.step)

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
                if resumed := self._resumed():
                    how = (f"{' and '.join(resumed)} resumed here: what the resume loaded differs: the checkpoint or "
                           "its loading, not this step's training")
                elif (configs := self._configs()) is None:
                    how = ("neither run resumed here: the initial weights differ: their seed (debug.seed), the "
                           "model's initialization code, or a checkpoint loaded as the initial weights")
                elif configs:
                    how = ("neither run resumed here: the initial weights differ; the configs differ in "
                           + ", ".join(configs))
                else:
                    how = ("neither run resumed here: the initial weights differ, the configs equal: the model's "
                           "initialization code, or a checkpoint loaded as the initial weights")
                return [f"{self._at(rank)}: {what} `{name}` entering the step differs, before any batch ({how})"]
        return None

    def data(self) -> list[str] | None:
        if not self.same_ranks:
            samples_a, samples_b = _samples(self.lines_a), _samples(self.lines_b)
            if samples_a != samples_b:
                return [f"step {self.step}: the samples of the step differ (as a set over every rank and micro-batch,"
                        f" {len(self.lines_a)} against {len(self.lines_b)} processes): the data, not the model"]
            return None
        if not self.same_split:
            for rank, (line_a, line_b) in enumerate(zip(self.lines_a, self.lines_b)):
                if _samples([line_a]) != _samples([line_b]):
                    return [f"{self._at(rank)}: the samples of the step differ (as a set over its micro-batches, "
                            f"{self._split_words(rank)}): the data, not the model"]
            return None
        for rank, (line_a, line_b) in enumerate(zip(self.lines_a, self.lines_b)):
            for index, (batch_a, batch_b) in enumerate(zip(line_a.get("batch", []), line_b.get("batch", []))):
                if batch_a == batch_b:
                    continue
                key = next(key for key in [*batch_a, *batch_b] if batch_a.get(key) != batch_b.get(key))
                rows = _differing_rows(batch_a.get(key, []), batch_b.get(key, []))
                return [f"{self._at(rank)}: the batch of micro-batch {index} differs (`{key}`, sample(s) "
                        f"{rows} of it): the data, not the model"]
        return None

    def _split_words(self, rank: int) -> str:
        split_a, split_b = self.splits[rank]
        return f"A {split_a} against B {split_b} micro-batches × samples"

    def modules(self) -> list[str] | None:
        if not self.same_split:
            return None
        first: tuple[int, int, str] | None = None  # (call index, rank, sentence)
        for rank, (line_a, line_b) in enumerate(zip(self.lines_a, self.lines_b)):
            calls_a, calls_b = line_a.get("modules"), line_b.get("modules")
            if calls_a is None or calls_b is None:
                continue
            for index, (call_a, call_b) in enumerate(zip(calls_a, calls_b)):
                if first is not None and index >= first[0]:
                    break
                sentence = _call_difference(call_a, call_b, self._drawn(rank))
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

    def losses(self) -> list[str] | None:
        if not self.same_split:
            return None
        for rank, (line_a, line_b) in enumerate(zip(self.lines_a, self.lines_b)):
            losses_a, losses_b = line_a.get("loss"), line_b.get("loss")
            if losses_a is None or losses_b is None or losses_a == losses_b:
                continue
            index = next(i for i, (x, y) in enumerate(zip(losses_a, losses_b)) if x != y)
            before = f", the losses of rank{'s 0..' if rank > 1 else ' '}{rank - 1} equal" if rank else ""
            if (drawn := self._drawn(rank)) is not None:
                cause = f"its random draws differ: {drawn}"
            else:
                cause = ("its random draws (dropout: --debug.rng_fingerprint tells) or a non-deterministic kernel "
                         f"({self._modules_hint('names the module')})")
            return [f"{self._at(rank)}: its loss of micro-batch {index} differs, the batches and the weights "
                    f"entering the step equal{before}: the forward pass on this rank, before any reduction over the "
                    f"ranks: {cause}"]
        return None

    def gradients(self) -> list[str] | None:
        found = self._per_rank(lambda r: self.lines_a[r].get("grad"), lambda r: self.lines_b[r].get("grad"))
        if found is None:
            return None
        rank, name = found
        drawn = self._drawn(rank) if rank is not None else None
        if not self.same_ranks:
            cause = (f"summed over {len(self.lines_a)} against {len(self.lines_b)} processes: another reduction "
                     "order (and each rank's own random draws), which is expected outside the world-size-invariant "
                     "mode")
            seen = "the same samples"
        elif not self.same_split:
            seen = f"the same samples, split as {self._split_words(rank or 0)}"
            cause = ("another split of the step: its sums run in another order, and its random draws fall per "
                     "micro-batch otherwise")
        elif drawn is not None:
            seen = "the batches and the weights entering the step equal"
            cause = f"its random draws differ: {drawn}"
        elif any("modules" in line for line in self.lines_a):
            seen = "the batches equal, every module's output equal"
            cause = ("the backward pass: a non-deterministic kernel (try --debug.deterministic), or the gradients' "
                     "reduction over the ranks")
        elif all("loss" in line for line in self.lines_a + self.lines_b):
            seen = "the batches, the weights entering the step and every rank's losses equal"
            cause = (f"the backward pass: a non-deterministic kernel ({self._modules_hint('rules out the forward')}), "
                     "or the gradients' reduction over the ranks")
        else:
            seen = "the batches and the weights entering the step equal"
            cause = ("the step's computation: its random draws (dropout: --debug.rng_fingerprint tells), a "
                     f"non-deterministic kernel ({self._modules_hint('names the module')}), or the gradients' "
                     "reduction over the ranks")
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
                configs = self._configs()
                which = f"; the configs differ in {', '.join(configs)}" if configs else ", e.g. the learning rate"
                return [f"{self._at(rank)}: {equal}, parameter `{name}` after the update differs (the optimizer: "
                        f"its state or its hyperparameters{which}; {self._state_compared()})"]
            return [f"{self._at(rank)}: {equal}, parameters after the update equal, optimizer state `{name}` "
                    f"differs (the optimizer's state: what it carries to the next step; {self._state_compared()})"]
        return None

    def _resumed(self) -> list[str]:
        """The runs (A, B) whose process started at this step after step 1: a resume."""
        return [label for label, lines in (("A", self.lines_a), ("B", self.lines_b))
                if any("entering" in line for line in lines) and self.step > 1]

    def _state_compared(self) -> str:
        """Where the optimizer state was last compared before this step's update. Each run hashes it where a
        process starts and at its saves (a difference there is named there); an empty state (before any update)
        is not counted as compared."""
        last = next((after for after in range(self.step - 1, -1, -1)
                     if all(run.entering(after + 1, 0, "optim") for run in (self.a, self.b))), None)
        if last == self.step - 1:
            return "the optimizer state equal where last compared, entering this step"
        how = "it is hashed where a process starts and at saves"
        if last is None:
            compared = f"the optimizer state not compared before ({how})"
        else:
            compared = f"the optimizer state equal where last compared, entering step {last + 1}"
        if len(resumed := self._resumed()) == 1:
            other = "A" if resumed == ["B"] else "B"
            loaded = (f"the optimizer state {resumed[0]}'s resume loaded not compared: {other} hashed none after step "
                      f"{self.step - 1} ({how})")
            return loaded if last is None else f"{loaded}; {compared}"
        return compared


def _split(line: dict[str, Any]) -> str:
    """``M × N``: the line's micro-batches and the samples of each (``8+4`` where they are not all of one size)."""
    sizes = [len(next(iter(batch.values()), [])) for batch in line.get("batch", [])]
    if len(set(sizes)) <= 1:
        return f"{len(sizes)} × {sizes[0] if sizes else 0}"
    return "+".join(map(str, sizes))


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


def _call_difference(call_a: list[Any], call_b: list[Any], drawn: str | None) -> str | None:
    """What the first differing call says; ``drawn``: the streams of this rank the stream diagnosis named."""
    name_a, inputs_a, outputs_a = call_a[:3]
    name_b, inputs_b, outputs_b = call_b[:3]
    if name_a != name_b:
        return f"the modules ran in another order (A called `{name_a}` where B called `{name_b}`): another model"
    if inputs_a != inputs_b:
        return (f"`{name_a}` input differs, every module call that ended before it gave equal outputs: the "
                "difference arose outside any module (code between modules, or the step's input)")
    if outputs_a == outputs_b:
        return None
    if len(call_a) > 3 and len(call_b) > 3:  # each call's draws recorded: null for none, else the state it drew from
        drew_a, drew_b = call_a[3], call_b[3]
        if (drew_a is None) != (drew_b is None):
            drew, did_not = ("A", "B") if drew_a is not None else ("B", "A")
            return (f"`{name_a}` output differs, its input equal: its random draws differ: it drew random numbers in "
                    f"{drew} and none in {did_not} (dropout switched off in {did_not}?)")
        if drew_a != drew_b:
            return (f"`{name_a}` output differs, its input equal: its random draws differ: the random streams entering "
                    "it differ" + (f" ({drawn})" if drawn is not None else " (--debug.rng_fingerprint names which)"))
    elif drawn is not None:
        return f"`{name_a}` output differs, its input equal: its random draws differ: {drawn}"
    return (f"`{name_a}` output differs, its input equal (a kernel: an operation inside it gave other bits; "
            "its parameters entered the step equal)")


def locate(a: RunPrints, b: RunPrints, up_to: int | None = None, draws: Draws | None = None) -> Finding | None:
    """The first thing that differs, up to step ``up_to``, in the order entering state, data, forward, losses,
    gradient, update; None when every fingerprint both runs hold is equal. ``draws``: the streams the stream
    diagnosis found differing, which then name random draws as the cause on their ranks."""
    for step in sorted(set(a.steps) & set(b.steps)):
        if up_to is not None and step > up_to:
            break
        checks = _Step(a, b, step, draws)
        computation = (checks.modules, checks.losses, checks.gradients)
        for check in (checks.entering, checks.data, *computation, checks.update):
            lines = check()
            if lines is not None:
                return Finding(step, lines, check in computation and checks.same_split)
    return None


def module_origins(a: RunPrints, b: RunPrints, step: int) -> list[str]:
    """Per rank, in its execution order (the order calls ended), the first module call of ``step`` whose output
    differs: ``step 6, rank 1: module layers.0.attn (call 3 of the step): inputs equal, output differs``, or
    where its input differs too, or the modules ran otherwise, that instead. A rank whose calls are all equal (or
    that recorded none) has no line."""
    lines = []
    for rank, (line_a, line_b) in enumerate(zip(a.ranks(step), b.ranks(step))):
        calls_a, calls_b = line_a.get("modules") or [], line_b.get("modules") or []
        for index, (call_a, call_b) in enumerate(zip(calls_a, calls_b), start=1):
            (name, inputs_a, outputs_a), (name_b, inputs_b, outputs_b) = call_a[:3], call_b[:3]
            where = f"step {step}, rank {rank}: module {name} (call {index} of the step)"
            if name != name_b:
                lines.append(f"{where}: B called {name_b} there: the modules ran in another order (another model)")
            elif inputs_a != inputs_b:
                lines.append(f"{where}: input differs, every call that ended before it equal: the difference arose "
                             "outside any module (code between modules)")
            elif outputs_a != outputs_b:
                drew = "" if call_a[3:] == call_b[3:] else "; its random draws differ"
                lines.append(f"{where}: inputs equal, output differs{drew}")
            else:
                continue
            break
        else:
            if len(calls_a) != len(calls_b):
                lines.append(f"step {step}, rank {rank}: the modules ran another number of times (A {len(calls_a)} "
                             f"calls, B {len(calls_b)}): another model or schedule")
    return lines


class TensorPrints:
    """Both runs' tensor fingerprints, read once: the first tensor that differs, and what the runs recorded about
    how they were launched (for the random-stream diagnosis' hints)."""

    def __init__(self, run_a: Path, run_b: Path) -> None:
        self.a, self.b = read_prints(run_a), read_prints(run_b)

    def launches(self, step: int) -> Launches:
        """Whether either run resumed up to ``step``, and the keys in which their configs differ there."""
        if self.a is None or self.b is None or step not in self.a.steps or step not in self.b.steps:
            return Launches()
        return Launches(resumed_by(self.a, self.b, step), config_differences(self.a, self.b, step))

    def outside_the_trainer(self) -> bool:
        """Whether a run's fingerprints were recorded outside this project's trainer: no stream-fingerprint option
        to advise there."""
        return any(run is not None and recorded_outside_the_trainer(run) for run in (self.a, self.b))

    def finding(self, up_to: int | None = None, draws: Draws | None = None) -> Finding | None:
        """The first difference up to step ``up_to`` (see :func:`locate`); None where nothing differs or a run
        has no fingerprints."""
        return locate(self.a, self.b, up_to, draws) if self.a is not None and self.b is not None else None

    def report(self, up_to: int | None = None, draws: Draws | None = None) -> tuple[str, list[str]]:
        """("found", lines) naming the first difference; ("equal", lines) when every fingerprint matched;
        ("absent", lines) when one run has none (a hint), or ("absent", []) when neither has any."""
        a, b = self.a, self.b
        if a is None and b is None:
            return "absent", []
        if a is None or b is None:
            return "absent", [f"tensor fingerprints only in {'B' if a is None else 'A'}: run both with "
                              "--debug.tensor_fingerprint to learn which tensor differed first"]
        finding = self.finding(up_to, draws)
        if finding is None:
            span = f"up to step {up_to}" if up_to is not None else "at every step both hold"
            return "equal", [f"every tensor fingerprint equal {span} (batches, gradients, parameters, and the "
                             "optimizer state where both hashed it: at starts and saves)"]
        return "found", ["the first tensor that differs: " + finding.lines[0], *finding.lines[1:]]

    def lines_for(self, first_loss_step: int | None, draws: Draws | None = None) -> list[str]:
        """Lines for compare_losses: where the losses part at ``first_loss_step``, the first tensor that differs
        up to it; where they do not (None), a note only when a tensor differs all the same."""
        state, lines = self.report(first_loss_step, draws)
        if first_loss_step is not None:
            return lines
        return ["note: the losses are equal, but " + lines[0], *lines[1:]] if state == "found" else []
