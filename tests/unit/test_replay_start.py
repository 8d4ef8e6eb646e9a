"""Where ``replay`` and ``samples`` find a run and how ``replay`` starts it: checkpoints on a store
(``--checkpoint.folder``), a mistyped URL, the process count that trained the run, the recorded values rather
than the run's (relative) config file, and the checkpoint the run itself started from. Real checkpoints written
in this process by the CheckpointManager; the replay's processes are stood in for (the e2e tests of
tests/e2e/test_spikes.py run them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.launch import REPO
from torchtitan_rng import replay, resume, samples
from torchtitan_rng.checkpoint.manager import CheckpointManager
from torchtitan_rng.checkpoint.storage import checkpoint_folder, locate
from torchtitan_rng.config import JobConfig, parse_args, to_flags
from torchtitan_rng.errors import CheckpointError, ConfigError

CONFIG = "train_configs/llama_debug.toml"  # relative, as a run launched in the repository names it
STEPS = 6


class _Samples:
    def __len__(self) -> int:
        return 64


class _RanksState:
    """A train state as ``ranks`` processes save it (``train_state.rank_R``): what records the count."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks

    def state_dict(self) -> dict[str, Any]:
        return {f"rank_{rank}": torch.zeros(2) for rank in range(self.ranks)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _save(folder: str | Path, config: JobConfig, step: int, ranks: int = 1) -> None:
    manager = CheckpointManager(folder, {"train_state": _RanksState(ranks)}, interval=1)
    manager.run_record = resume.build_record(config, _Samples())
    manager.save(step)


def _run(launched_in: Path, name: str, *flags: str, checkpoint_at: int = 2, ranks: int = 1,
         folder: str = "") -> Path:
    """A run launched in ``launched_in`` with ``--job.dump_folder name`` (relative) and the relative config
    file: a loss log of STEPS steps and its checkpoint of ``checkpoint_at`` (in ``folder`` when given)."""
    config = parse_args(["--job.config_file", str(REPO / CONFIG), "--job.dump_folder", name, *flags])
    config.job.config_file = CONFIG
    dump = launched_in / name
    dump.mkdir(parents=True)
    _save(folder or dump / "checkpoint", config, checkpoint_at, ranks)
    (dump / "loss_log.jsonl").write_text("".join(json.dumps({"step": step, "loss": 1.0, "lr": 0.1}) + "\n"
                                                 for step in range(1, STEPS + 1)))
    return dump


def _ranks(launched: list[tuple[JobConfig, int]]) -> Any:
    """In place of the replay's processes: note their config and count, and report an empty step."""
    def ranks(config: JobConfig, processes: int) -> dict[str, Any]:
        launched.append((config, processes))
        step = config.training.steps
        (Path(config.job.dump_folder)).mkdir(parents=True)
        (Path(config.job.dump_folder) / "loss_log.jsonl").write_text(
            json.dumps({"step": step, "loss": 1.0, "samples": []}) + "\n")
        return {"losses": [], "micro_batch_grads": [], "micro_batch_samples": [], "step_grads": {},
                "update_norm": 0.0}
    return ranks


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[tuple[JobConfig, int]]:
    noted: list[tuple[JobConfig, int]] = []
    monkeypatch.setattr(replay, "_replay_on", _ranks(noted))
    return noted


def _one_error_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def test_replay_defaults_to_the_count_that_trained_the_run(tmp_path: Path, launched: list[tuple[JobConfig, int]],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A 2-process run replays on 2 processes without --processes; control: 1 is refused, naming 2."""
    dump = _run(tmp_path, "run", ranks=2)
    assert replay.main([str(dump), "--step", "3"]) == 0
    assert [processes for _, processes in launched] == [2]
    assert f"replayed step 3 of {dump} on 2 process(es)" in capsys.readouterr().out
    assert replay.main([str(dump), "--step", "3", "--processes", "1"]) == 2
    assert "--processes 1 cannot replay this run exactly" in _one_error_line(capsys.readouterr().err)
    assert len(launched) == 1


def test_replay_runs_from_the_record_anywhere_and_saves_nothing(tmp_path: Path,
                                                                launched: list[tuple[JobConfig, int]],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The run named its config file relative to where it was launched; the replay, run elsewhere, hands its
    processes the recorded values (which they read back here) with no file to read, and saves no checkpoint.
    Control: the recorded file name, handed on, cannot be read here."""
    dump = _run(tmp_path / "launched_here", "run")
    monkeypatch.chdir(tmp_path)
    assert replay.main([str(dump), "--step", "3"]) == 0
    (config, _), = launched
    assert parse_args(to_flags(config)).training == config.training
    assert not config.checkpoint.enable and config.checkpoint.initial_load_path == str(dump / "checkpoint" / "step-2")
    config.job.config_file = CONFIG
    with pytest.raises(ConfigError, match="does not exist"):
        parse_args(to_flags(config))


def test_replay_starts_where_the_run_started(tmp_path: Path, launched: list[tuple[JobConfig, int]],
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A run started with relative --checkpoint.initial_load_path base/checkpoint --checkpoint.load_step 2, with no
    checkpoint of its own before step 3: replayed from another folder, step 3 starts from base's step 2, and the
    line says so. Control: a run started afresh says "the start"; a copy moved away from its launch folder is
    refused in one line."""
    _run(tmp_path, "base", checkpoint_at=4)
    _save(tmp_path / "base" / "checkpoint", parse_args(["--job.config_file", str(REPO / CONFIG)]), 2)
    dump = _run(tmp_path, "next", "--checkpoint.initial_load_path", "base/checkpoint", "--checkpoint.load_step", "2",
                checkpoint_at=4)
    monkeypatch.chdir(REPO)
    assert replay.main([str(dump), "--step", "3"]) == 0
    start = tmp_path / "base" / "checkpoint" / "step-2"
    assert launched[-1][0].checkpoint.initial_load_path == str(start)
    assert (f"replayed step 3 of {dump} on 1 process(es) from checkpoint {start}, the run's "
            "checkpoint.initial_load_path") in capsys.readouterr().out
    fresh = _run(tmp_path, "fresh", checkpoint_at=4)
    assert replay.main([str(fresh), "--step", "3"]) == 0
    assert "from the start (no checkpoint before it)" in capsys.readouterr().out
    assert launched[-1][0].checkpoint.initial_load_path == ""
    moved = dump.rename(tmp_path / "moved")
    assert replay.main([str(moved), "--step", "3"]) == 2
    assert ("checkpoint.initial_load_path 'base/checkpoint', which is not there: run the replay in the folder"
            in _one_error_line(capsys.readouterr().err))


@pytest.mark.parametrize("tool", ["samples", "replay"])
def test_checkpoints_elsewhere_are_found_with_checkpoint_folder(tmp_path: Path, tool: str,
                                                                launched: list[tuple[JobConfig, int]],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A run whose checkpoint.folder was a URL (an fsspec store: memory://): without --checkpoint.folder the
    refusal says to give it; with it, the tool answers from the store."""
    url = f"memory://{tmp_path.name}/checkpoint"
    dump = _run(tmp_path, "run", "--checkpoint.folder", url, folder=url)
    main = samples.main if tool == "samples" else replay.main
    assert main([str(dump), "--step", "3"]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert f"{dump} holds no complete checkpoint" in err and "--checkpoint.folder URL" in err
    assert main([str(dump), "--step", "3", "--checkpoint.folder", url]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 0: " in out if tool == "samples" else f"from checkpoint {locate(url) / 'step-2'}\n" in out


@pytest.mark.parametrize("tool", ["samples", "replay"])
def test_a_url_with_one_slash_is_refused(tmp_path: Path, tool: str, capsys: pytest.CaptureFixture[str]) -> None:
    dump = _run(tmp_path, "run")
    main = samples.main if tool == "samples" else replay.main
    assert main([str(dump), "--step", "3", "--checkpoint.folder", "s3:/bkt/x"]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        "error: 's3:/bkt/x' is not a URL (one slash after s3:) and is not taken for a folder; write s3://bkt/x\n")
    assert not (dump / "s3:").exists()


def test_storage_refuses_a_url_with_one_slash() -> None:
    """Wherever a folder may be a URL (checkpoint.folder, initial_load_path); control: two slashes, a path, a
    drive letter."""
    for mistyped, meant in [("s3:/bkt/x", "s3://bkt/x"), ("gs:/b", "gs://b"), ("file:/tmp/x", "file:///tmp/x")]:
        with pytest.raises(CheckpointError, match=f"write {meant}$"):
            locate(mistyped)
        with pytest.raises(CheckpointError, match=f"write {meant}$"):
            checkpoint_folder("run", mistyped)
    assert str(locate("memory://bkt/x")) == "memory:///bkt/x"
    assert locate("C:/x").local == Path("C:/x")
    assert checkpoint_folder("run", "checkpoint").local == Path("run/checkpoint")


def test_samples_of_an_invariant_run_resumed_at_another_count(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A world-size-invariant run trained to step 2 on 2 processes, resumed on 1 to step 4: a step up to 2 is
    labelled with the 2 processes that trained it, a later one with 1; the keys are in slot order, the same list
    at either count (as both runs logged them). Control: the ordinary mode's order depends on the count."""
    flags = ("--parallelism.world_size_invariant", "--training.global_batch_size", "16",
             "--training.local_batch_size", "4")
    dump = _run(tmp_path, "run", *flags, ranks=2)
    config = parse_args(["--job.config_file", str(REPO / CONFIG), "--job.dump_folder", "run", *flags])
    _save(dump / "checkpoint", config, 4, ranks=1)
    plan = samples.mode_of(config.parallelism)
    for step, count in [(1, 2), (2, 2), (3, 1), (4, 1), (5, 1)]:
        keys, num_samples, world_size, _ = samples.step_samples(dump, step)
        assert (world_size, keys) == (count, plan.step_sample_keys(config, num_samples, count, step)), step
    assert plan.step_sample_keys(config, 64, 2, 1) == plan.step_sample_keys(config, 64, 1, 1)
    ordinary = parse_args(["--job.config_file", str(REPO / CONFIG), "--training.global_batch_size", "16",
                           "--training.local_batch_size", "4"])
    assert samples.mode_of(ordinary.parallelism).step_sample_keys(ordinary, 64, 2, 1) != \
        samples.mode_of(ordinary.parallelism).step_sample_keys(ordinary, 64, 1, 1)
    assert samples.main([str(dump), "--step", "1"]) == 0
    assert "in slot order, trained on 2 process(es)" in capsys.readouterr().out
