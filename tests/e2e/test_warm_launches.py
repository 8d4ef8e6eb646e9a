"""The suite's warm starts reach every process of a launch: the launcher and each rank torchrun starts are
forked from the warm server (tests/support/zygote.py), not new interpreters. A rank that went cold costs a
whole interpreter start-up per rank per run, and nothing else would say so: the runs still pass."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from tests.support.launch import REPO, launch, run_env
from torchtitan_rng.launch.runs import training_command


def _forked(record: Path) -> list[str]:
    """The programs of the processes the server forked, from its lines in the launch record."""
    return sorted(json.loads(line)["program"] for line in record.read_text().splitlines())


def test_launcher_and_each_rank_are_forked(tmp_path: Path) -> None:
    record = tmp_path / "record.jsonl"
    command = training_command(REPO / "train_configs" / "llama_debug.toml",
                               ["--job.dump_folder", str(tmp_path / "run"), "--training.steps", "1"], 2)
    proc = launch(command, env=run_env({"TORCHTITAN_RNG_LAUNCH_RECORD": str(record)}), processes=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _forked(record) == ["torchtitan_rng.launch.launcher", "torchtitan_rng.train", "torchtitan_rng.train"]


def test_a_forked_process_ignores_sigint_exactly_when_a_new_one_would(tmp_path: Path) -> None:
    """A new interpreter keeps SIGINT ignored when its parent ignores it (a suite started in the background), and
    raises KeyboardInterrupt on it otherwise; a forked one must do the same, whatever the server's own start left.
    One server answers both: one of the two necessarily differs from its own state."""
    script = tmp_path / "sigint.py"
    script.write_text("import signal\nprint(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)\n")
    record = tmp_path / "record.jsonl"
    previous = signal.getsignal(signal.SIGINT)
    try:
        for disposition, ignored in ((signal.SIG_IGN, "True"), (signal.default_int_handler, "False")):
            signal.signal(signal.SIGINT, disposition)
            proc = launch([sys.executable, str(script)], env=run_env({"TORCHTITAN_RNG_LAUNCH_RECORD": str(record)}))
            assert proc.returncode == 0 and proc.stdout.strip() == ignored, (disposition, proc.stdout, proc.stderr)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert _forked(record) == ["sigint.py", "sigint.py"]  # both forked by the server
