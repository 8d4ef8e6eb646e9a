"""The torchtitan plug-in (``--override.imports torchtitan_rng.integrations.torchtitan.exact_resume``) with the
real torchtitan 0.3 wheel: 2 processes on the CPU (gloo, FSDP2), a 2-layer llama with attention dropout, and a
tiny Flux (at the end of the file). The 2-D, context- and expert-parallel layouts (4 processes): the slow tier's
tests/e2e/test_torchtitan_layouts.py.

Every run trains the same 4 steps (or part of them); the losses are torchtitan's own float32 global average
loss, compared bit for bit by ``compare_losses``: the plug-in's runs write ``loss_log.jsonl`` themselves (equal
bit for bit to torchtitan's TensorBoard scalars, checked below); stock runs have no plug-in, so their
TensorBoard events are converted into a loss log here:

* plug-in, stopped at the end of ``--training.steps 2`` and resumed to 4 == uninterrupted, every step;
* controls: stock torchtitan resuming the plug-in's checkpoint at the stop differs; the plug-in restoring the
  streams inside the checkpoint load (before ``iter(dataloader)``) differs;
* a stock checkpoint resumes with the plug-in (one WARNING line); a plug-in checkpoint resumes in stock
  torchtitan, which ignores the streams: it holds every key of stock's checkpoint at the same step, bit for bit;
* the plug-in's checkpoint at the stop resumed by 1 process, and that run's checkpoint by 2 processes: each one
  WARNING line naming both layouts and the rule for each rank's streams;
* (slow tier) Flux (torchtitan's FluxTrainer, validating): its checkpoint at 2 resumed to 4 == uninterrupted;
  stock resuming it differs; with a loader worker (1 process; the random crop and caption dropout drawn in the
  worker): resumed == uninterrupted; the same checkpoint resumed with the worker's streams not carried differs;
* (slow tier) pipeline parallel 2 (Interleaved1F1B, stopped by SIGTERM to one rank, saving asynchronously: every
  rank saves a full checkpoint at the agreed step and exits 0; 1F1B) and tensor parallel 2: resumed ==
  uninterrupted; stock torchtitan resuming the same checkpoint differs; under tensor parallelism the ranks' mask
  streams are equal at every save, as the plug-in's check says;
* (slow tier) without ``--debug.seed`` (torchtitan seeds at random) rank 0 names the run in one WARNING line,
  and two such runs differ from step 1; a bad option (a string where a list of signals goes) is one line from
  rank 0 and exit 2, no rank's traceback;
* the plug-in's runs validate at steps 1, 2 and 4, and validation's loader draws from the global generator;
  the streams saved at step 2 are those before that step's validation, so the resumes above are exact (and
  equal stock's unvalidated losses up to the stop) only because validation moves no training stream (the
  wrapper's control: in-process, below).

The runs are the documented CPU example's (examples/torchtitan_cpu: its CPU adjustments, tiny configs and offline
assets; the plug-in depends on none of it), with their files in a temporary folder. Each fixture's runs
go side by side as cores free up (``together``); the learning rate is flat after warm-up
(``--lr_scheduler.decay_ratio 0``) because torchtitan builds its schedule on ``training.steps``, which the
end-of-steps stop changes.

What costs is the number of launches (each starts torchrun and its ranks; a step costs little), so runs are
shared: one uninterrupted run per model and layout is the reference, and, but for the one end-of-steps stop
and the one signalled stop, the resumes and the controls start from the checkpoint it saved on its way (the
same state at the same step boundary: a resume cannot tell it from a stopped run's). The losses are compared
in this process (``compare_records``, what ``python -m torchtitan_rng.compare_losses`` prints); the command
itself runs once, with ``--plot``.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checks import assert_same_tensors, load_checkpoint
from tests.support.integrations.torchtitan_launch import (EXAMPLE, PLUGIN, PRELOAD, assets, compare_dumps,  # noqa: F401
                                                          copy_checkpoint, first_difference, titan_command,
                                                          plugin_flags, signalled_run, stock_loss_log, stop_step,
                                                          tensorboard_losses, titan_env, train_titan)
from tests.support.launch import compare, launch, together
from torchtitan_rng.loss_log import read_loss_log

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                reason="torchtitan is not installed (pip install -e '.[torchtitan]')")

STEPS, STOP = 4, 2
STREAMS_WARNING = "WARNING - torchtitan_rng: checkpoint"  # torchtitan's log format: "... - WARNING - message"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> dict[str, Path]:
    """The llama runs (2 processes, FSDP2): the plug-in uninterrupted (``full``), and stopped at the end of
    ``--training.steps 2`` then resumed to 4 (``stopped``); the stopped run's checkpoint resumed by the plug-in
    restoring inside the load (``at_load``), by stock torchtitan (``plugin_ckpt``) and by 1 process (``fewer``,
    to 3), whose checkpoint 2 processes resume (``more``); stock torchtitan stopped at 2 (``stock``) and its
    checkpoint resumed by the plug-in (``stock_ckpt``)."""
    root = tmp_path_factory.mktemp("torchtitan")
    names = ("full", "stopped", "stock", "at_load", "stock_ckpt", "plugin_ckpt", "fewer", "more")
    dumps = {name: root / name for name in names}
    plugin, at_load = plugin_flags(assets), plugin_flags(assets, restore_streams_at="load")
    outputs: dict[str, str] = {}

    def keep(name: str, proc: subprocess.CompletedProcess) -> None:
        outputs[name] = proc.stdout + proc.stderr

    def other_process_counts() -> None:
        # The 2-process checkpoint resumed by 1 process, for one step, whose checkpoint 2 processes resume.
        # torchtitan's dataloader refuses another dp degree (an assertion), so its state is not loaded: the
        # documented way to change the process count.
        other = (*plugin, "--checkpoint.exclude_from_loading", "dataloader")
        keep("fewer", train_titan(assets, dumps["fewer"], STOP + 1, *other, nproc=1))
        copy_checkpoint(dumps["fewer"], dumps["more"], STOP + 1)
        keep("more", train_titan(assets, dumps["more"], STEPS, *other))

    def stopped_and_resumed() -> None:
        train_titan(assets, dumps["stopped"], STOP, *plugin)
        for name in ("at_load", "plugin_ckpt", "fewer"):
            copy_checkpoint(dumps["stopped"], dumps[name], STOP)
        together(lambda: keep("stopped", train_titan(assets, dumps["stopped"], STEPS, *plugin)),
                 # gc_freq changes no loss but is not a quiet key: the resume names it (the run-record check).
                 lambda: keep("at_load", train_titan(assets, dumps["at_load"], STEPS, *at_load, "--training.gc_freq",
                                                "49")),
                 lambda: keep("plugin_ckpt", train_titan(assets, dumps["plugin_ckpt"], STEPS)), other_process_counts)

    def stock() -> None:
        train_titan(assets, dumps["stock"], STOP)
        copy_checkpoint(dumps["stock"], dumps["stock_ckpt"], STOP)
        keep("stock_ckpt", train_titan(assets, dumps["stock_ckpt"], STEPS, *plugin))

    together(lambda: train_titan(assets, dumps["full"], STEPS, *plugin), stopped_and_resumed, stock)
    (root / "outputs.json").write_text(json.dumps(outputs))
    return dumps


def _outputs(runs: dict[str, Path]) -> dict[str, str]:
    return json.loads((runs["full"].parent / "outputs.json").read_text())


def test_stopped_at_end_of_steps_and_resumed_is_bitwise(runs: dict[str, Path]) -> None:
    result = compare_dumps(runs["full"], runs["stopped"])
    assert result.equal, result.message


def test_plugin_loss_log_is_torchtitans_float32_loss_bit_for_bit(runs: dict[str, Path]) -> None:
    from torchtitan_rng.compare_losses import same_bits

    for name in ("full", "stopped", "at_load"):
        lines = [json.loads(line) for line in (runs[name] / "loss_log.jsonl").read_text().splitlines()]
        # One writer (rank 0 here), each step once: the resumed runs append only the steps they train (at_load's
        # folder started with the stopped run's lines up to the stop, its TensorBoard events with the resume).
        assert [line["step"] for line in lines] == list(range(1, STEPS + 1)), f"{name}: {lines}"
        logged, board = read_loss_log(runs[name]), tensorboard_losses(runs[name])
        trained = list(range(STOP + 1 if name == "at_load" else 1, STEPS + 1))
        assert sorted(board) == trained, (name, board)
        assert all(same_bits(logged[step]["loss"], board[step]) for step in board), (name, logged, board)
        assert all(logged[step]["lr"] > 0 and logged[step]["grad_norm"] > 0 for step in logged), logged
    # The comparison above catches a loss that is not torchtitan's: the restore-at-load run's differs.
    assert not same_bits(read_loss_log(runs["at_load"])[STOP + 1]["loss"], tensorboard_losses(runs["full"])[STOP + 1])


def test_compare_losses_plots_torchtitan_dump_folders(runs: dict[str, Path]) -> None:
    # The command itself on torchtitan dump folders (the other tests compare in-process): exit 0 on the plug-in's
    # stopped and resumed run, exit 1 on stock resuming its checkpoint and on the plug-in restoring at load.
    exact = compare(runs["full"], runs["stopped"])
    assert exact.returncode == 0, exact.stdout + exact.stderr
    for control in ("plugin_ckpt", "at_load"):
        plot = runs["full"].parent / f"full_vs_{control}.png"
        result = compare(runs["full"], runs[control], "--plot", str(plot))
        assert result.returncode == 1 and f"first differing step {STOP + 1}:" in result.stdout, result.stdout
        # torchtitan has no --debug.rng_fingerprint: the diagnosis names what there is instead.
        assert "no RNG fingerprints in A and B: torchtitan runs have none" in result.stdout, result.stdout
        assert "--debug.rng_fingerprint" not in result.stdout, result.stdout
        assert plot.stat().st_size > 0, result.stdout + result.stderr


def test_controls_stock_and_restore_before_iter_differ(runs: dict[str, Path]) -> None:
    # Stock torchtitan resuming the plug-in's checkpoint (it ignores the streams: they start where torchtitan
    # seeds them), and the plug-in restoring them before iter(dataloader): both differ from the first resumed step.
    for control in ("plugin_ckpt", "at_load"):
        result = compare_dumps(runs["full"], runs[control])
        assert first_difference(result) == STOP + 1, f"{control}: {result.message}"


def test_changed_config_key_is_named_on_resume(runs: dict[str, Path]) -> None:
    outputs = _outputs(runs)
    drift = [line for line in outputs["at_load"].splitlines() if "WARNING - torchtitan_rng: training." in line]
    assert len(drift) == 1 and "training.gc_freq = 49 but the checkpoint was trained with 50" in drift[0], drift
    # The end-of-steps resume changes training.steps, which the flat schedule does not depend on: no line.
    assert "WARNING - torchtitan_rng" not in outputs["stopped"]


def test_config_drift_names_the_lr_horizon_only_where_the_schedule_uses_it() -> None:
    from torchtitan_rng.integrations.torchtitan import config_drift

    saved = {"training.steps": 10, "lr_scheduler.decay_ratio": 0.8, "checkpoint.interval": 5, "training.seed": 1}
    assert config_drift(saved, dict(saved)) == []
    [line] = config_drift(saved, dict(saved, **{"training.steps": 20, "checkpoint.interval": 2}))
    assert line.startswith("training.steps = 20 but the checkpoint was trained with 10")
    flat = dict(saved, **{"lr_scheduler.decay_ratio": 0})
    assert config_drift(flat, dict(flat, **{"training.steps": 20})) == []


def test_validation_leaves_the_training_streams_where_it_found_them() -> None:
    import random

    import numpy as np
    import torch

    from torchtitan_rng.integrations.torchtitan import _PreservedStreamsValidator
    from torchtitan_rng.rng import capture_global_rng, fingerprint

    class DrawingValidator:
        freq = 2

        def validate(self, model_parts: list, step: int) -> int:
            torch.rand(1), np.random.rand(), random.random()
            return step

    cpu = torch.device("cpu")
    before = fingerprint(capture_global_rng(cpu))
    wrapped = _PreservedStreamsValidator(DrawingValidator(), cpu)
    assert wrapped.validate([], 3) == 3 and wrapped.freq == 2
    assert fingerprint(capture_global_rng(cpu)) == before
    DrawingValidator().validate([], 3)  # control: unwrapped, the same validation moves every stream
    assert fingerprint(capture_global_rng(cpu)) != before


def test_stock_checkpoint_resumes_with_one_warning(runs: dict[str, Path]) -> None:
    out = _outputs(runs)["stock_ckpt"]
    warnings = [line for line in out.splitlines() if STREAMS_WARNING in line]
    assert len(warnings) == 1, f"expected one WARNING line, got {warnings}"
    assert "holds no random streams" in warnings[0] and "not exact" in warnings[0]
    assert (runs["stock_ckpt"] / "checkpoint" / f"step-{STEPS}").is_dir()


def test_another_process_count_is_named_once_with_the_rule(runs: dict[str, Path]) -> None:
    out = _outputs(runs)["fewer"]
    warnings = [line for line in out.splitlines() if "WARNING - torchtitan_rng" in line]
    expected = ("torchtitan_rng: the checkpoint was saved by 2 processes (dp_shard 2) and this run has 1 process "
                "(no parallelism): rank 0 restores the streams saved by the rank of the same number; the streams "
                "saved by rank 1 are not used; this resume is not exact")
    assert len(warnings) == 1 and warnings[0].endswith(expected), warnings
    assert json.loads((runs["stopped"] / "checkpoint" / f"step-{STOP}" / "run.json").read_text())["layout"] == {
        "world_size": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "pp": 1, "ep": 1}
    # Control: the same-layout resumes of the same checkpoint say nothing of the kind.
    assert "saved by" not in _outputs(runs)["stopped"] + _outputs(runs)["at_load"]


def test_more_processes_are_named_once_with_the_rule(runs: dict[str, Path]) -> None:
    # The 1-process checkpoint (``fewer``'s, at 3) resumed by 2 processes: the new rank keeps its own streams,
    # never rank 0's.
    warnings = [line for line in _outputs(runs)["more"].splitlines() if "WARNING - torchtitan_rng" in line]
    expected = ("torchtitan_rng: the checkpoint was saved by 1 process (no parallelism) and this run has 2 processes "
                "(dp_shard 2): rank 0 restores the streams saved by the rank of the same number; rank 1, new, keeps "
                "the streams torchtitan seeded at start, as in a fresh run; this resume is not exact")
    assert len(warnings) == 1 and warnings[0].endswith(expected), warnings
    assert json.loads((runs["fewer"] / "checkpoint" / f"step-{STOP + 1}" / "run.json").read_text())["layout"][
        "world_size"] == 1
    assert (runs["more"] / "checkpoint" / f"step-{STEPS}").is_dir()


def test_plugin_checkpoint_resumes_in_stock_torchtitan(runs: dict[str, Path], tmp_path: Path) -> None:
    from torchtitan_rng.integrations.torchtitan import STREAMS_PART

    # Stock torchtitan loads the keys it asks for and ignores the streams: the plug-in's checkpoint at the stop
    # holds every key of stock's checkpoint at the same step, bit for bit, so stock resumes it as it resumes its
    # own; and it did, saying nothing (its losses differ from the first resumed step: the control above).
    assert STREAMS_WARNING not in _outputs(runs)["plugin_ckpt"]
    assert (runs["plugin_ckpt"] / "checkpoint" / f"step-{STEPS}").is_dir()
    stock = load_checkpoint(runs["stock"] / "checkpoint" / f"step-{STOP}", tmp_path / "stock.pt")
    plugin = load_checkpoint(runs["stopped"] / "checkpoint" / f"step-{STOP}", tmp_path / "plugin.pt")
    assert set(plugin) - set(stock) == {STREAMS_PART}, sorted(plugin)
    assert_same_tensors(stock, {key: plugin[key] for key in stock})
    # Control: the same comparison with the plug-in's checkpoint two steps later fails.
    later = load_checkpoint(runs["stopped"] / "checkpoint" / f"step-{STEPS}", tmp_path / "later.pt")
    with pytest.raises(AssertionError, match="differ|!="):
        assert_same_tensors(stock, {key: later[key] for key in stock})


@pytest.fixture(scope="module")
def unseeded_runs(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> dict[str, Path]:
    """Two plug-in runs of one step without ``--debug.seed`` (2 processes): torchtitan seeds each at random."""
    root = tmp_path_factory.mktemp("torchtitan_unseeded")
    dumps = {name: root / name for name in ("first", "second")}
    together(*(lambda dump=dump: train_titan(assets, dump, 1, "--override.imports", PLUGIN, seed=None)
               for dump in dumps.values()))
    return dumps


@pytest.mark.slow  # two launches as new interpreters (about 45 s of runs on 2 cores)
def test_an_unseeded_run_is_named_and_cannot_be_compared(unseeded_runs: dict[str, Path]) -> None:
    from torchtitan_rng.integrations.torchtitan.seed import unseeded_run

    for dump in unseeded_runs.values():
        out = (dump.parent / f"{dump.name}.out").read_text()
        warnings = [line for line in out.splitlines() if "WARNING - torchtitan_rng" in line]
        assert len(warnings) == 1 and warnings[0].endswith(str(unseeded_run(None))), warnings
    # What the line says: two runs of the same command differ from step 1. (Its control, a seeded run saying
    # nothing: test_changed_config_key_is_named_on_resume's stopped run, seeded, has no torchtitan_rng WARNING.)
    result = compare_dumps(unseeded_runs["first"], unseeded_runs["second"])
    assert first_difference(result) == 1, result.message


@pytest.mark.slow  # the message and the exit are unit-tested (tests/unit/test_torchtitan_options.py)
def test_a_bad_option_is_one_line_from_rank_0_and_exit_2(assets: Path, tmp_path: Path) -> None:
    # A string where the option takes a list (it used to be read letter by letter, as the signal 'S').
    bad = PLUGIN + '={"signals": "SIGTERM"}'
    proc = launch(titan_command(assets, tmp_path / "bad", 1, "--override.imports", bad),
                  env=titan_env(assets / "hf_home"), timeout=400, processes=2, preload=PRELOAD)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    lines = [line for line in out.splitlines() if "torchtitan_rng:" in line]
    assert len(lines) == 1 and lines[0].endswith(
        'ERROR - torchtitan_rng: exact_resume option "signals" is "SIGTERM", not a list of signal names: write it '
        'as {"signals": ["SIGTERM", "SIGUSR1"]}'), lines
    # The ranks exited 2 (torchrun ends the others with SIGTERM once one has exited), before building anything,
    # without a traceback: the one traceback is torchrun's own report of failed ranks (ChildFailedError, whatever
    # made them fail; the stock command has no other launcher).
    codes = re.findall(r"exitcode  : (-?\d+)", out)
    assert "2" in codes and set(codes) <= {"2", "-15"} and "Building llama3" not in out, out[-3000:]
    assert out.count("Traceback (most recent call last)") == 1 and "ChildFailedError" in out, out[-5000:]


# Pipeline and tensor parallelism on 2 processes (no data parallelism): the plug-in uninterrupted and resumed,
# and the control, stock torchtitan resuming the plug-in's checkpoint (it ignores the streams). torch 2.13 runs
# torchtitan's pre-split pipeline step through the plug-in's stand-in (provide_presplit_step).
PP = ("--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs")
LAYOUTS = {"interleaved": (*PP, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"),
           "1f1b": (*PP, "--parallelism.pipeline_parallel_schedule", "1F1B"),
           "tp": ("--parallelism.tensor_parallel_degree", "2")}
SIGNALLED = "interleaved"  # the layout whose run is stopped by a signal
# The slow tier, which CI runs on torch 2.13 and on the newest torch of the range (its pre-split pipeline step):
# the everyday suite keeps the plug-in's FSDP runs above.
CI_TIER = pytest.mark.slow


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> dict[str, Path]:
    """For each layout: ``{layout}_full`` (to 4, saving at 2 and 4), ``{layout}_stopped`` (resumed to 4) and
    ``{layout}_stock`` (stock torchtitan resuming ``{layout}_full``'s checkpoint at 2). Interleaved1F1B's run
    is stopped by a SIGTERM to one rank (at whichever step the ranks agree on), saving with
    ``--checkpoint.async_mode async``; the others resume ``{layout}_full``'s checkpoint at 2."""
    root = tmp_path_factory.mktemp("torchtitan_parallel")
    dumps = {f"{layout}_{run}": root / f"{layout}_{run}" for layout in LAYOUTS for run in ("full", "stopped", "stock")}
    outputs: dict[str, str] = {}

    def signalled(layout: str) -> None:
        # Saving asynchronously: the stop's checkpoint goes through torchtitan's async save (a save at the
        # last step of --training.steps is always synchronous).
        extra = (*LAYOUTS[layout], "--checkpoint.async_mode", "async")
        outputs[layout] = signalled_run(assets, dumps[f"{layout}_stopped"], STEPS, *plugin_flags(assets), *extra).stdout
        train_titan(assets, dumps[f"{layout}_stopped"], STEPS, *plugin_flags(assets), *extra)

    def full_and_resumed(layout: str) -> None:
        extra, full = LAYOUTS[layout], dumps[f"{layout}_full"]
        train_titan(assets, full, STEPS, *plugin_flags(assets), *extra)
        resumes = ("stock",) if layout == SIGNALLED else ("stock", "stopped")
        for run in resumes:
            copy_checkpoint(full, dumps[f"{layout}_{run}"], STOP)
        together(lambda: train_titan(assets, dumps[f"{layout}_stock"], STEPS, *extra),
                 *([] if layout == SIGNALLED else
                   [lambda: train_titan(assets, dumps[f"{layout}_stopped"], STEPS, *plugin_flags(assets), *extra)]))

    together(lambda: signalled(SIGNALLED), *(lambda layout=layout: full_and_resumed(layout) for layout in LAYOUTS))
    (root / "outputs.json").write_text(json.dumps(outputs))
    return dumps


@CI_TIER
def test_sigterm_saves_full_checkpoint_at_agreed_step_and_resume_is_bitwise(parallel_runs: dict[str, Path]) -> None:
    from torchtitan_rng.checkpoint.safe_load import SafeFileSystemReader

    # Interleaved1F1B, SIGTERM to one rank: both ranks report the same step, saved a full checkpoint there
    # (asynchronously) and exited 0; the resume from it is bitwise (the next test checks the losses too).
    outputs = json.loads((parallel_runs["tp_full"].parent / "outputs.json").read_text())
    stopped = parallel_runs[f"{SIGNALLED}_stopped"]
    step = stop_step(outputs[SIGNALLED], 2, STEPS)
    keys = set(SafeFileSystemReader(stopped / "checkpoint" / f"step-{step}").read_metadata().state_dict_metadata)
    assert {"torchtitan_rng.rank_0", "torchtitan_rng.rank_1"} <= keys
    assert any(key.startswith("optimizer.") for key in keys), "the signal's checkpoint holds no optimizer state"
    assert f"Training starts at step {step + 1}" in (stopped.parent / f"{stopped.name}.out").read_text()
    result = compare_dumps(parallel_runs[f"{SIGNALLED}_full"], stopped)
    assert result.equal, result.message


@CI_TIER
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_and_tensor_parallel_stopped_and_resumed_are_bitwise(parallel_runs: dict[str, Path],
                                                                      layout: str) -> None:
    result = compare_dumps(parallel_runs[f"{layout}_full"], parallel_runs[f"{layout}_stopped"])
    assert result.equal, result.message


@CI_TIER
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_and_tensor_parallel_stock_resume_differs(parallel_runs: dict[str, Path], layout: str) -> None:
    result = compare_dumps(parallel_runs[f"{layout}_full"], parallel_runs[f"{layout}_stock"])
    assert first_difference(result) == STOP + 1, result.message


@CI_TIER
def test_tensor_parallel_ranks_hold_equal_mask_streams_at_every_save(parallel_runs: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    from torchtitan_rng.checkpoint.train_state import decode_state
    from torchtitan_rng.integrations.torchtitan import MASK_STREAMS
    from torchtitan_rng.rng import fingerprint

    # The plug-in compares the group's mask streams at each save (steps 2 and 4) and says so; no difference.
    out = (parallel_runs["tp_full"].parent / "tp_full.out").read_text()
    for step in (STOP, STEPS):
        assert f"torchtitan_rng: step {step}: the mask streams of tensor-parallel ranks 0, 1 are equal" in out, step
    assert "tensor-parallel group hold different" not in out
    # What the check saw, read back from the checkpoints: rank 0's and rank 1's mask streams are the same at each
    # save. Control: the same comparison tells the streams of step 2 from those of step 4 (the masks drew).
    seen = {}
    for step in (STOP, STEPS):
        saved = load_checkpoint(parallel_runs["tp_full"] / "checkpoint" / f"step-{step}", tmp_path / f"{step}.pt")
        ranks = [decode_state(saved["torchtitan_rng"][f"rank_{rank}"])["rng"] for rank in (0, 1)]
        seen[step] = [{name: fingerprint(streams[name]) for name in MASK_STREAMS} for streams in ranks]
        assert seen[step][0] == seen[step][1], (step, seen[step])
    assert seen[STOP][0]["torch_cpu"] != seen[STEPS][0]["torch_cpu"]


@CI_TIER
def test_pipeline_loss_log_is_written_by_the_last_stage(parallel_runs: dict[str, Path]) -> None:
    from torchtitan_rng.compare_losses import same_bits

    # Under pipeline parallelism only the last stage's rank has the loss (torchtitan logs -1.0 on the others):
    # the loss log holds that rank's losses, equal bit for bit to torchtitan's TensorBoard scalars.
    for layout in ("interleaved", "1f1b"):
        logged, board = read_loss_log(parallel_runs[f"{layout}_full"]), tensorboard_losses(
            parallel_runs[f"{layout}_full"])
        assert sorted(logged) == sorted(board) == list(range(1, STEPS + 1)), (logged, board)
        assert all(same_bits(logged[step]["loss"], board[step]) and board[step] > 0 for step in board), layout


# Flux: torchtitan 0.3's own Flux trainer (FluxTrainer, flux_debugmodel shrunk by the example's tiny_flux),
# offline: a local byte-level tokenizer for T5 and CLIP, randomly initialised tiny encoders, a WebDataset tar.
# Its randomness is torchtitan's: the noise and timesteps of every step, the random crop and the caption
# dropout drawn while the main process iterates the dataset (no loader workers), and the validator's sampling.
FLUX_STEPS, FLUX_STOP = STEPS, STOP


def _flux_command(assets: dict[str, Path], dump: Path, steps: int, *extra: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            str(EXAMPLE / "train.py"), "--module", "tiny_configs", "--config", "tiny_flux",
            "--hf_assets_path", str(assets["tokenizer"]), "--tokenizer.t5_tokenizer_path", str(assets["tokenizer"]),
            "--tokenizer.clip_tokenizer_path", str(assets["tokenizer"]),
            "--encoder.t5_encoder", str(assets["t5_encoder"]), "--encoder.clip_encoder", str(assets["clip_encoder"]),
            "--dataloader.dataset", "cc12m-test", "--dataloader.dataset_path", str(assets["images"]),
            "--dump_folder", str(dump), "--debug.seed", "7",
            "--checkpoint.enable", "--checkpoint.interval", str(FLUX_STOP), "--metrics.log_freq", "1",
            "--training.steps", str(steps), *extra]


def _flux_train(assets: dict[str, Path], dump: Path, steps: int, *extra: str, nproc: int = 2) -> str:
    proc = launch(_flux_command(assets, dump, steps, *extra, nproc=nproc), env=titan_env(assets["hf_home"]),
                  timeout=400, processes=nproc, preload=PRELOAD)
    (dump.parent / f"{dump.name}.out").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"{dump.name} exited {proc.returncode}\n{proc.stderr[-5000:]}"
    if not any(arg.startswith(PLUGIN) for arg in extra):
        stock_loss_log(dump)
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def flux_runs(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> dict[str, Path]:
    """The plug-in's Flux run uninterrupted (``full``: 2 processes, validating at steps 1, 2 and 4; the
    validator samples images from random noise) and its checkpoint at 2 resumed to 4 (``stopped``, validating at
    4); stock torchtitan resuming the same checkpoint, without validation (``stock``; stock validation moves the
    training streams: it would differ from step 3 anyway).

    With a loader worker (``workers_*``, 1 process: the claim is about the worker, whose streams are the
    process's own; the random crop and caption dropout are drawn in the worker): the plug-in uninterrupted, its
    checkpoint at 2 resumed to 4, and the control, the same checkpoint resumed with ``worker_streams`` off (the
    worker restarts its streams from the loader's seed)."""
    root = tmp_path_factory.mktemp("flux")
    flux = {name: assets / name for name in ("tokenizer", "t5_encoder", "clip_encoder", "images", "hf_home")}
    names = ("full", "stopped", "stock", "workers_full", "workers_stopped", "workers_off")
    dumps = {name: root / name for name in names}
    plugin = ("--override.imports", PLUGIN, "--validator.enable", "--validator.freq", str(FLUX_STOP),
              "--validator.steps", "1", "--validator.dataloader.dataset_path", str(flux["images"]),
              "--validator.sampling.denoising_steps", "2")
    worker = ("--dataloader.num_workers", "1")
    workers, workers_off = (("--override.imports", PLUGIN + (f"={json.dumps(options)}" if options else ""), *worker)
                            for options in ({}, {"worker_streams": False}))
    outputs: dict[str, str] = {}

    def full_and_resumed() -> None:
        outputs["full"] = _flux_train(flux, dumps["full"], FLUX_STEPS, *plugin)
        for name in ("stopped", "stock"):
            copy_checkpoint(dumps["full"], dumps[name], FLUX_STOP)
        together(lambda: outputs.setdefault("stopped", _flux_train(flux, dumps["stopped"], FLUX_STEPS, *plugin)),
                 lambda: _flux_train(flux, dumps["stock"], FLUX_STEPS, "--metrics.enable_tensorboard"))

    def workers_full_and_resumed() -> None:
        outputs["workers_full"] = _flux_train(flux, dumps["workers_full"], FLUX_STEPS, *workers, nproc=1)
        for name in ("workers_stopped", "workers_off"):
            copy_checkpoint(dumps["workers_full"], dumps[name], FLUX_STOP)
        together(lambda: _flux_train(flux, dumps["workers_stopped"], FLUX_STEPS, *workers, nproc=1),
                 lambda: outputs.setdefault("workers_off", _flux_train(flux, dumps["workers_off"], FLUX_STEPS,
                                                                       *workers_off, nproc=1)))

    together(full_and_resumed, workers_full_and_resumed)
    (root / "outputs.json").write_text(json.dumps(outputs))
    return dumps


def _flux_outputs(flux_runs: dict[str, Path]) -> dict[str, str]:
    return json.loads((flux_runs["full"].parent / "outputs.json").read_text())


@CI_TIER
def test_flux_stopped_and_resumed_is_bitwise_with_validation(flux_runs: dict[str, Path]) -> None:
    outputs = _flux_outputs(flux_runs)
    # torchtitan validates at step 1 and every validator.freq steps: the uninterrupted run at 1, 2 and 4, after
    # saving at 2 (the checkpoint holds the streams from before that validation); the resumed run at 4.
    assert all(f"validate step: {step:2}" in outputs["full"] for step in (1, FLUX_STOP, FLUX_STEPS))
    assert f"validate step: {FLUX_STEPS:2}" in outputs["stopped"]
    assert f"Training starts at step {FLUX_STOP + 1}" in outputs["stopped"], outputs["stopped"][-3000:]
    result = compare_dumps(flux_runs["full"], flux_runs["stopped"])
    assert result.equal, result.message


@CI_TIER
def test_flux_stock_control_differs_from_the_first_resumed_step(flux_runs: dict[str, Path]) -> None:
    result = compare_dumps(flux_runs["full"], flux_runs["stock"])
    assert first_difference(result) == FLUX_STOP + 1, result.message


@CI_TIER
def test_flux_with_a_loader_worker_stopped_and_resumed_is_bitwise(flux_runs: dict[str, Path]) -> None:
    result = compare_dumps(flux_runs["workers_full"], flux_runs["workers_stopped"])
    assert result.equal, result.message
    assert "WARNING - torchtitan_rng" not in _flux_outputs(flux_runs)["workers_full"]


@CI_TIER
def test_flux_worker_control_restarted_worker_streams_differ_and_are_named(flux_runs: dict[str, Path]) -> None:
    result = compare_dumps(flux_runs["workers_full"], flux_runs["workers_off"])
    assert first_difference(result) == FLUX_STOP + 1, result.message
    warnings = [line for line in _flux_outputs(flux_runs)["workers_off"].splitlines()
                if "WARNING - torchtitan_rng" in line]
    assert len(warnings) == 1 and "the dataloader runs 1 worker and worker_streams is off" in warnings[0], warnings
