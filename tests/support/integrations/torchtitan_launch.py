"""Test support: launching torchtitan 0.3 with and without the plug-in (torchrun on the CPU: the documented example
examples/torchtitan_cpu, its CPU adjustments and tiny configs) and reading what the runs leave, for the plug-in's
end-to-end test modules.

Stock runs have no plug-in to write the loss log, so their TensorBoard events are converted into one
(:func:`stock_loss_log`); losses are compared in the test's process (``compare_records``, what
``python -m torchtitan_rng.compare_losses`` prints)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.launch import REPO, launch, run_env
from torchtitan_rng.compare_losses import Comparison, compare_records
from torchtitan_rng.loss_log import read_loss_log

EXAMPLE = REPO / "examples" / "torchtitan_cpu"
# The runs' warm server imports the example's train.py as a module (the CPU adjustments, then torchtitan) and
# torchtitan's Flux trainer once, not each rank of each run (tests/support/launch.py). One server per test
# module: every run of a module has the same start-up environment (one HF_HOME).
PRELOAD = (str(EXAMPLE / "train.py"), "torchtitan.models.flux.trainer")
PLUGIN = "torchtitan_rng.integrations.torchtitan.exact_resume"


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the runs read, written by the example's write_assets.py (``tokenizer/``, ``text/``, and Flux's
    ``t5_encoder/``, ``clip_encoder/``, ``images/``), and the Hugging Face cache of every run of the module
    (``hf_home/``: one start-up environment, one warm server)."""
    root = tmp_path_factory.mktemp("torchtitan_assets")
    proc = launch([sys.executable, str(EXAMPLE / "write_assets.py"), str(root)], env=titan_env(root / "hf_home"),
                  preload=PRELOAD)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root


def titan_command(assets: Path, dump: Path, steps: int, *extra: str, nproc: int = 2, seed: int | None = 7,
                  config: str = "tiny_llama") -> list[str]:
    """torchrun of ``config`` (a function of the example's tiny_configs.py), saving every 2 steps, logging every
    step."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            str(EXAMPLE / "train.py"), "--module", "tiny_configs", "--config", config,
            "--hf_assets_path", str(assets / "tokenizer"), "--dataloader.dataset_path", str(assets / "text"),
            "--dump_folder", str(dump), "--lr_scheduler.decay_ratio", "0",
            *(("--debug.seed", str(seed)) if seed is not None else ()),
            "--checkpoint.enable", "--checkpoint.interval", "2", "--metrics.enable_tensorboard",
            "--metrics.log_freq", "1", "--training.steps", str(steps), *extra]


def plugin_flags(assets: Path, **options: object) -> tuple[str, ...]:
    """The plug-in, and validation at steps 1, 2 and 4 (each builds a loader whose iter() draws from the global
    generator). Stock runs do not validate: stock validation moves the training streams, so a stock run that
    validates differs from the plug-in's runs from step 2 on, stopped or not."""
    target = PLUGIN + (f"={json.dumps(options)}" if options else "")
    return ("--override.imports", target, "--validator.enable", "--validator.freq", "2", "--validator.steps", "1",
            "--validator.dataloader.dataset", "c4_test", "--validator.dataloader.dataset_path", str(assets / "text"))


def titan_env(hf_home: Path) -> dict[str, str]:
    # train.py's folder is first on the ranks' sys.path: --module tiny_configs is found there.
    return run_env({"HF_HOME": str(hf_home), "HF_DATASETS_OFFLINE": "1"})


def compare_dumps(a: Path, b: Path) -> Comparison:
    """The loss logs of two dump folders compared bit for bit, as ``compare_losses`` compares them."""
    return compare_records(read_loss_log(a), read_loss_log(b))


def first_difference(result: Comparison) -> int | None:
    """The first step whose losses differ, None where the logs agree (or differ only in which steps they hold)."""
    return result.first_step if result.loss_differs else None


def train_titan(assets: Path, dump: Path, steps: int, *extra: str, nproc: int = 2, seed: int | None = 7,
                config: str = "tiny_llama", timeout: float = 400) -> subprocess.CompletedProcess:
    """One run to ``steps`` into ``dump`` (its output in ``{dump}.out``), which must exit 0; a stock run's
    TensorBoard losses become its loss log."""
    # An unseeded run starts new interpreters: forked from the warm server, every run would start with its seed.
    proc = launch(titan_command(assets, dump, steps, *extra, nproc=nproc, seed=seed, config=config),
                  env=titan_env(assets / "hf_home"), timeout=timeout, processes=nproc, preload=PRELOAD,
                  warm=seed is not None)
    (dump.parent / f"{dump.name}.out").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"{dump.name} exited {proc.returncode}\n{proc.stderr[-5000:]}"
    if not any(arg.startswith(PLUGIN) for arg in extra):
        stock_loss_log(dump)
    return proc


def tensorboard_losses(dump: Path) -> dict[int, float]:
    """torchtitan's logged losses (TensorBoard scalars, float32); a step logged by a later run (after a resume)
    counts with its later value."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    losses: dict[int, float] = {}
    for events in sorted((dump / "tb").rglob("events.out.tfevents.*")):
        for event in EventFileLoader(str(events)).Load():
            for value in event.summary.value:
                if value.tag.endswith("global_avg_loss"):
                    losses[event.step] = value.tensor.float_val[0] if value.tensor.float_val else value.simple_value
    return losses


def stock_loss_log(dump: Path) -> None:
    """A stock run's losses (it has no plug-in to write them) as this project's loss log, from TensorBoard,
    after the lines of the steps it did not train (those copied with the checkpoint it resumed)."""
    board = tensorboard_losses(dump)
    log = dump / "loss_log.jsonl"
    before = [line for line in (log.read_text().splitlines() if log.is_file() else [])
              if json.loads(line)["step"] not in board]
    log.write_text("".join(line + "\n" for line in before) + "".join(
        json.dumps({"step": step, "loss": loss, "lr": 0.0}) + "\n" for step, loss in sorted(board.items())))


def copy_checkpoint(source: Path, dump: Path, step: int) -> None:
    """A new run folder holding only ``source``'s checkpoint at ``step`` and its loss log's lines up to it (not
    its TensorBoard events, which may go further: the new run's events are its own steps)."""
    shutil.copytree(source / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
    lines = (source / "loss_log.jsonl").read_text().splitlines()
    (dump / "loss_log.jsonl").write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= step))


def rank_pids(torchrun: subprocess.Popen, count: int) -> list[int]:
    """The training processes torchrun started (its children), waiting until all ``count`` exist."""
    children = Path(f"/proc/{torchrun.pid}/task/{torchrun.pid}/children")
    while True:
        pids = [int(pid) for pid in children.read_text().split()]
        if len(pids) == count or torchrun.poll() is not None:
            return pids
        time.sleep(0.01)  # polling interval of the watch, not a synchronisation delay


def signalled_run(assets: Path, dump: Path, steps: int, *extra: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """A run to ``steps`` (with ``extra``: the plug-in's flags and the layout's), SIGTERM to its last rank as soon
    as training starts; it must exit 0."""
    out = dump.parent / f"{dump.name}.out"
    with out.open("w") as sink:
        proc = subprocess.Popen(titan_command(assets, dump, steps, *extra, nproc=nproc), cwd=REPO,
                                stdout=sink, stderr=subprocess.STDOUT, text=True, env=titan_env(assets / "hf_home"))
        try:
            while "Training starts at step 1" not in out.read_text():
                assert proc.poll() is None, f"the run ended before training started\n{out.read_text()[-4000:]}"
                time.sleep(0.01)  # polling interval of the watch, not a synchronisation delay
            pids = rank_pids(proc, nproc)
            assert len(pids) == nproc, f"torchrun has children {pids}"
            os.kill(pids[-1], signal.SIGTERM)  # one rank only: the ranks must agree on the stop
            proc.wait(timeout=400)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = out.read_text()
    assert proc.returncode == 0, f"the signalled run exited {proc.returncode}\n{text[-5000:]}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, text, "")


def stop_step(out: str, ranks: int, steps: int) -> int:
    """The step every rank of a signalled run saved at and stopped (each of its ``ranks`` reports it once),
    before its last step ``steps``."""
    stops = [line for line in out.splitlines() if "stop signal: saved a full checkpoint at step" in line]
    assert len(stops) == ranks, f"every rank reports one stop\n{out[-4000:]}"
    step = int(stops[0].split("at step ")[1].split(";")[0])
    assert all(f"at step {step};" in line for line in stops), stops
    assert step < steps, f"the run stopped at its last step {step}: the signal was not heeded"
    return step
