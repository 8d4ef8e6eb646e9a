"""Loading never executes code: ``samples``, ``replay`` and ``compare_losses --locate`` import no module a
checkpoint's ``run.json`` names (``job.custom_module``) unless the user names it on their command line, and check
the checkpoint's files before reading any value. Real checkpoints written in this process by the CheckpointManager; a module whose import
leaves a mark (a file) stands for the code."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.launch import REPO
from tests.unit.test_tensor_locator import _changed, _gradient, synthetic, write
from torchtitan_rng import compare_losses, replay, resume, samples
from torchtitan_rng.checkpoint.manager import CheckpointManager
from torchtitan_rng.config import JobConfig, parse_args

CONFIG = str(REPO / "train_configs" / "llama_debug.toml")
STEPS = 4


class _Samples:
    def __len__(self) -> int:
        return 64


class _RankState:
    """A train state as one process saves it (``train_state.rank_0``): the record of one process's run."""

    def state_dict(self) -> dict[str, Any]:
        return {"rank_0": torch.zeros(2)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@pytest.fixture
def marking_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """(name, mark): a module on the path whose import writes ``mark``; the name is unique per test."""
    name = f"marks_on_import_{tmp_path.name.replace('-', '_')}"
    folder, mark = tmp_path / "code", tmp_path / "imported"
    folder.mkdir()
    (folder / f"{name}.py").write_text(f"from pathlib import Path\nPath({str(mark)!r}).write_text('imported')\n")
    monkeypatch.syspath_prepend(str(folder))
    yield name, mark
    sys.modules.pop(name, None)


def _run(dump: Path, token_file: Path, module: str) -> Path:
    """A run's dump folder: a loss log of STEPS steps and the checkpoint of step 2, whose record names
    ``module`` (and a token file, so that ``samples`` looks its spec up for the token offsets)."""
    config = parse_args(["--job.config_file", CONFIG, "--training.dataset_path", str(token_file),
                         "--job.custom_module", module, "--job.dump_folder", str(dump)])
    manager = CheckpointManager(dump / "checkpoint", {"train_state": _RankState()}, interval=1)
    manager.run_record = resume.build_record(config, _Samples())
    manager.save(2)
    (dump / "loss_log.jsonl").write_text("".join(json.dumps({"step": step, "loss": 1.0, "lr": 0.1}) + "\n"
                                                 for step in range(1, STEPS + 1)))
    return dump


def _damage_record(dump: Path) -> None:
    """run.json edited without its checksums (the trainer refuses such a checkpoint as damaged)."""
    record_file = dump / "checkpoint" / "step-2" / "run.json"
    record = json.loads(record_file.read_text())
    record["config"]["debug.seed"] += 1
    record_file.write_text(json.dumps(record))


def _ranks_of(launched: list[JobConfig]) -> Any:
    """In place of the replay's processes: note their config and look its spec up, as each rank does first."""
    def ranks(config: JobConfig, processes: int) -> dict[str, Any]:
        from torchtitan_rng.models import get_train_spec

        launched.append(config)
        get_train_spec(config)
        raise replay.ReplayFailed(3)
    return ranks


def _one_error_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("damaged", [False, True], ids=["checksummed", "damaged"])
def test_replay_imports_no_module_a_checkpoint_names(tmp_path: Path, token_files: dict[str, Path],
                                                     marking_module: tuple[str, Path], damaged: bool,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    name, mark = marking_module
    dump = _run(tmp_path / "run", token_files["bin"], name)
    if damaged:
        _damage_record(dump)
    launched: list[JobConfig] = []
    monkeypatch.setattr(replay, "_replay_on", _ranks_of(launched))
    assert replay.main([str(dump), "--step", "3"]) == 2
    err = _one_error_line(capsys.readouterr().err)
    if damaged:  # the damage is found before the record is read
        assert "is damaged: run.json " in err and name not in err
    else:
        assert f"pass --job.custom_module {name} if you trust it" in err
    assert not mark.exists() and name not in sys.modules and not launched


def test_replay_hands_the_ranks_the_module_the_user_names(tmp_path: Path, token_files: dict[str, Path],
                                                          marking_module: tuple[str, Path],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: named on the command line, the module is the replay's (its ranks import it as a run's do)."""
    name, mark = marking_module
    dump = _run(tmp_path / "run", token_files["bin"], name)
    launched: list[JobConfig] = []
    monkeypatch.setattr(replay, "_replay_on", _ranks_of(launched))
    assert replay.main([str(dump), "--step", "3", "--job.custom_module", name]) == 3
    assert [config.job.custom_module for config in launched] == [name] and mark.exists()


def test_locate_imports_no_module_a_run_names(tmp_path: Path, token_files: dict[str, Path],
                                              marking_module: tuple[str, Path], monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Two runs whose gradients part at step 2 (fingerprints written beside real checkpoints of step 2): --locate
    refuses in one line, before launching either replay, unless the module is named; control: named, the first
    replay is launched with it, from the run's start (no checkpoint before step 2), module hooks at step 2."""
    name, mark = marking_module
    a = write(_run(tmp_path / "a", token_files["bin"], name), synthetic())
    b = write(_run(tmp_path / "b", token_files["bin"], name), _changed(_gradient))
    launched: list[JobConfig] = []
    monkeypatch.setattr(replay, "_replay_on", _ranks_of(launched))
    assert compare_losses.main([str(a), str(b), "--locate"]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: --locate cannot rebuild A ({a}): checkpoint {a / 'checkpoint' / 'step-2'} was trained with "
        f"job.custom_module {name!r}, code that is imported only when you name it: pass --job.custom_module {name} "
        "if you trust it\n")
    assert not mark.exists() and name not in sys.modules and not launched
    assert compare_losses.main([str(a), str(b), "--locate", "--job.custom_module", name]) == 2
    assert _one_error_line(capsys.readouterr().err) == (f"error: --locate: the replay of A ({a}) failed (exit 3); its "
                                                        "processes' output is above\n")
    assert [(config.job.custom_module, config.debug.tensor_fingerprint, config.debug.fingerprint_modules_at_step,
             config.checkpoint.initial_load_path, config.training.steps) for config in launched] == [
        (name, True, 2, "", 2)] and mark.exists()


def test_samples_imports_no_module_a_checkpoint_names(tmp_path: Path, token_files: dict[str, Path],
                                                      marking_module: tuple[str, Path],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The keys need no code: printed, without the token offsets (which need the run's spec), and one line
    saying how to get them; control: named on the command line, the module is imported."""
    name, mark = marking_module
    dump = _run(tmp_path / "run", token_files["bin"], name)
    assert samples.main([str(dump), "--step", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.err == (f"note: no token offsets: this run was trained with job.custom_module {name!r}, code "
                            f"that is imported only when you name it: pass --job.custom_module {name} if you "
                            "trust it\n")
    assert "micro-batch 0: " in captured.out and "@" not in captured.out
    assert not mark.exists() and name not in sys.modules
    # Control: the user names it (it registers no model, so the offsets still cannot be had, said in one line).
    assert samples.main([str(dump), "--step", "3", "--job.custom_module", name]) == 0
    assert mark.exists()


def test_samples_refuses_a_damaged_record(tmp_path: Path, token_files: dict[str, Path],
                                          marking_module: tuple[str, Path],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A run.json edited without its checksums: refused in one line as the trainer does, never answered from
    (control: the same run undamaged answers)."""
    name, mark = marking_module
    dump = _run(tmp_path / "run", token_files["bin"], name)
    assert samples.main([str(dump), "--step", "3", "--json"]) == 0
    capsys.readouterr()
    _damage_record(dump)
    assert samples.main([str(dump), "--step", "3", "--json"]) == 2
    captured = capsys.readouterr()
    err = _one_error_line(captured.err)
    assert "is damaged: run.json " in err and not captured.out
    assert not mark.exists()
