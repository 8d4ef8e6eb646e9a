"""Compare two loss logs bit for bit.

    python -m torchtitan_rng.compare_losses RUN_A RUN_B

RUN_A/RUN_B are loss_log.jsonl files or the dump folders holding them. Exit 0 when both cover the same
steps (with --only-common-steps: on the steps both hold) with bitwise-equal losses; 1 with the first
differing step otherwise; 2 when a log cannot be read.

When both runs logged with --debug.rng_fingerprint, the first differing step comes with a diagnosis: which
random stream differed first, on which rank (see divergence.py); when both ran with --debug.tensor_fingerprint,
which tensor differed first: a batch, a module's output, a gradient, a parameter (see locator.py). Where the
runs are torchtitan's (the plug-in), whose runs record no fingerprints, it says what tells there instead.
``--plot out.png`` draws both curves and their difference (needs matplotlib).

``--locate`` goes down to the module where the first tensor that differs is inside a step's computation (the
batches and the weights entering the step equal; a module's output, a loss or a gradient not): it replays that
step of each run, from its newest checkpoint before the step or from its start, with every module call
fingerprinted, and prints per rank the first call whose inputs are equal and whose output differs (see
locate_module.py). A run trained with a ``job.custom_module`` is replayed only when the same module is
named (``--job.custom_module NAME``). The exit codes stay those above; a run that cannot be replayed is one
``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from torchtitan_rng.diagnosis.divergence import ADVICE, describe, diagnose, first_stream_divergence
from torchtitan_rng.diagnosis.locator import Draws, Finding, TensorPrints
from torchtitan_rng.diagnosis.plot import plot_losses, pyplot
from torchtitan_rng.errors import ConfigError, TorchtitanRngError, report, torch_missing
from torchtitan_rng.loss_log import read_loss_log, same_bits


# What tells where torchtitan trained a run (the plug-in records no stream fingerprints; these are what it has).
TORCHTITAN_ADVICE = ("torchtitan runs have none (the torchtitan_rng plug-in records no stream fingerprints; its "
                     "\"tensor_fingerprint\" option names the first tensor that differs): set the same "
                     "--debug.seed in both (torchtitan seeds at random without it), read the plug-in's "
                     "`torchtitan_rng:` WARNING lines of a resume (a changed config key, another process count or "
                     "layout, a checkpoint without streams), and rerun both with --debug.deterministic to rule out "
                     "non-deterministic kernels")


OUTSIDE_ADVICE = ("ExactResume and the HF Trainer and Lightning integrations record none (--debug.rng_fingerprint "
                  "is the trainer's option); their tensor fingerprints say what differs")


def _advice(run_a: Path, run_b: Path, prints: TensorPrints) -> str:
    """What to run for stream fingerprints, as far as the runs tell which trainer wrote them."""
    if _torchtitan_run(run_a) or _torchtitan_run(run_b):
        return TORCHTITAN_ADVICE
    return OUTSIDE_ADVICE if prints.outside_the_trainer() else ADVICE


def _torchtitan_run(run: Path) -> bool:
    """Whether torchtitan trained ``run``: the plug-in's run record (in each checkpoint of torchtitan's default
    folder) spells the config as torchtitan does (``dump_folder``), this project's trainer ``job.dump_folder``."""
    folder = run if run.is_dir() else run.parent
    for path in sorted(folder.glob("checkpoint/step-*/run.json")):
        if not path.is_file():
            continue
        try:
            config = json.loads(path.read_text(encoding="utf-8")).get("config")
        except (OSError, ValueError, AttributeError):
            continue
        return isinstance(config, dict) and "dump_folder" in config and "job.dump_folder" not in config
    return False


def _span(steps: list[int]) -> str:
    return f"{len(steps)} steps ({steps[0]}..{steps[-1]})" if steps else "no steps"


@dataclass
class Comparison:
    equal: bool
    message: str
    first_step: int | None = None
    # True when first_step is a step both logs hold with different losses (not a step only one holds).
    loss_differs: bool = False


def compare_records(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]],
                    only_common_steps: bool = False) -> Comparison:
    if only_common_steps:
        common = set(a) & set(b)
        if not common:
            return Comparison(False, "the logs have no step in common")
        a = {step: a[step] for step in common}
        b = {step: b[step] for step in common}
    steps_a, steps_b = sorted(a), sorted(b)
    for step in sorted(set(a) & set(b)):
        loss_a, loss_b = float(a[step]["loss"]), float(b[step]["loss"])
        if not same_bits(loss_a, loss_b):
            return Comparison(
                False,
                f"first differing step {step}: A loss {loss_a!r}, B loss {loss_b!r}, difference {loss_b - loss_a!r}",
                step,
                loss_differs=True,
            )
    if steps_a != steps_b:
        only_a = sorted(set(a) - set(b))
        only_b = sorted(set(b) - set(a))
        return Comparison(
            False,
            f"the logs cover different steps: A has {_span(steps_a)}, B has {_span(steps_b)}"
            f" (only in A: {_span(only_a)}; only in B: {_span(only_b)})",
            (only_a + only_b)[0],
        )
    return Comparison(True, f"identical: {_span(steps_a)} with bitwise-equal losses")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtitan_rng.compare_losses", description=__doc__.split("\n")[1])
    parser.add_argument("run_a", type=Path, help="loss_log.jsonl or the dump folder of run A")
    parser.add_argument("run_b", type=Path, help="loss_log.jsonl or the dump folder of run B")
    parser.add_argument("--only-common-steps", action="store_true",
                        help="compare the steps both logs hold (e.g. a run resumed from an older checkpoint)")
    parser.add_argument("--plot", type=Path, metavar="OUT.png",
                        help="draw both loss curves and their difference, the first divergence marked")
    parser.add_argument("--locate", action="store_true",
                        help="where the first tensor that differs is inside a step's computation (both runs trained "
                             "with --debug.tensor_fingerprint and checkpoints): replay that step of each run with "
                             "module hooks and name, per rank, the first module call whose inputs are equal and "
                             "whose output differs")
    parser.add_argument("--job.custom_module", dest="custom_module", default="", metavar="NAME",
                        help="with --locate: the module a run was trained with (job.custom_module); a run's own is "
                             "never imported unless named here")
    args = parser.parse_args(argv)
    try:
        if args.plot is not None:
            pyplot()  # fail on a missing matplotlib before comparing anything
        if args.locate and (missing := torch_missing("compare_losses --locate")) is not None:
            raise missing
        records_a, records_b = read_loss_log(args.run_a), read_loss_log(args.run_b)
        prints = TensorPrints(args.run_a, args.run_b)
    except TorchtitanRngError as err:
        return report(err)
    result = compare_records(records_a, records_b, args.only_common_steps)
    print(result.message)
    divergence = None
    if result.loss_differs:
        print("\n".join(diagnose(records_a, records_b, result.first_step, prints.launches(result.first_step),
                                 _advice(args.run_a, args.run_b, prints))))
        divergence = first_stream_divergence(records_a, records_b, up_to=result.first_step)
    elif result.equal and (divergence := first_stream_divergence(records_a, records_b)) is not None:
        print("note: the losses are equal, but " + "\n".join(describe(divergence, records_a, records_b,
                                                                        prints.launches(divergence.step))))
    draws = Draws(divergence.step, divergence.drawing()) if divergence is not None else None
    for line in prints.lines_for(result.first_step if result.loss_differs else None, draws):
        print(line)
    if args.plot is not None:
        plot_losses(records_a, records_b, result.first_step if result.loss_differs else None, args.plot)
        print(f"plot written to {args.plot}")
    if args.locate:
        finding = prints.finding(result.first_step if result.loss_differs else None, draws)
        try:
            for line in _locate(args.run_a, args.run_b, prints, finding, args.custom_module):
                print(line, flush=True)  # the replays' own output (stderr) comes between
        except TorchtitanRngError as err:
            return report(err)
    return 0 if result.equal else 1


def _locate(run_a: Path, run_b: Path, prints: TensorPrints, finding: Finding | None,
            trusted_module: str) -> Iterator[str]:
    """``--locate``'s lines: the module calls that part first, or why there is nothing to replay."""
    if prints.a is None or prints.b is None:
        yield ("--locate: nothing to replay: it needs both runs' tensor fingerprints (--debug.tensor_fingerprint) "
               "to find a step whose computation differs")
    elif finding is None:
        yield "--locate: nothing to replay: every tensor fingerprint equal"
    elif not finding.in_computation:
        yield (f"--locate: nothing to replay: the first difference (step {finding.step}, above) is not in a step's "
               "forward or backward from equal batches and weights, split alike over the same ranks")
    elif prints.outside_the_trainer():
        raise ConfigError("--locate replays steps of this project's trainer, and these runs were trained elsewhere "
                          "(ExactResume, the HF Trainer or Lightning integration, the torchtitan plug-in): rerun both "
                          f"with fingerprint_modules_at_step {finding.step} and compare them again (each module call "
                          "is then compared)")
    else:
        # Imported here: replaying needs torch, which comparing does not.
        from torchtitan_rng.locate_module import locate_module

        yield from locate_module(run_a, run_b, finding, trusted_module)


if __name__ == "__main__":
    sys.exit(main())
