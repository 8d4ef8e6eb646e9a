"""Numbers a run cannot train with, and a TOML file too deep to read: one line naming the key, exit 2, from the same
entry point run_train.sh calls before any process starts (in process here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.launch import REPO
from torchtitan_rng.config import ConfigError, parse_args
from torchtitan_rng.launch import preflight

CONFIG = str(REPO / "train_configs" / "llama_debug.toml")


@pytest.mark.parametrize(("key", "value", "shown"), [
    ("optimizer.lr", "nan", "nan"), ("optimizer.lr", "inf", "inf"), ("optimizer.lr", "-inf", "-inf"),
    ("optimizer.lr", "1e400", "1e400"), ("optimizer.eps", "NaN", "NaN"), ("training.max_norm", "inf", "inf"),
    ("optimizer.beta2", "1e999", "1e999"),
])
def test_a_number_that_is_not_finite_is_refused_from_the_command_line(key: str, value: str, shown: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert preflight.main(["--job.config_file", CONFIG, f"--{key}", value]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: config {key} = {shown} is not a finite number; give a finite value\n"
    parse_args(["--job.config_file", CONFIG, f"--{key}", "0.5"])  # the control: a finite value is taken


@pytest.mark.parametrize(("toml", "shown"), [("nan", "nan"), ("inf", "inf"), ("-inf", "-inf"), ("1e400", "inf"),
                                              ("1" + "0" * 400, "inf")])
def test_a_number_that_is_not_finite_is_refused_from_the_file(tmp_path: Path, toml: str, shown: str) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f"[optimizer]\nlr = {toml}\n")
    with pytest.raises(ConfigError) as err:
        parse_args(["--job.config_file", str(config)])
    assert str(err.value) == f"config optimizer.lr = {shown} is not a finite number; give a finite value"
    config.write_text("[optimizer]\nlr = 0.5\n")  # the control
    assert parse_args(["--job.config_file", str(config)]).optimizer.lr == 0.5


def test_a_toml_nested_too_deep_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "deep.toml"
    config.write_text("[optimizer]\nlr = " + "[" * 5000 + "]" * 5000 + "\n")
    assert preflight.main(["--job.config_file", str(config)]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: config file {str(config)!r} nests arrays or tables too deep to read; a config is "
                   "sections of keys ([section] then key = value)\n")
    config.write_text("[optimizer]\nlr = " + "[" * 5 + "]" * 5 + "\n")  # the control: shallow, a type error
    assert preflight.main(["--job.config_file", str(config)]) == 2
    assert "expected a number" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "line"), [
    (["--debug.fingerprint_modules_at_step", "3"],
     "config debug.fingerprint_modules_at_step = 3 records module calls into the tensor fingerprints, which are off: "
     "add --debug.tensor_fingerprint"),
    (["--debug.fingerprint_optimizer_every_step"],
     "config debug.fingerprint_optimizer_every_step hashes the optimizer state into the tensor fingerprints, which "
     "are off: add --debug.tensor_fingerprint"),
    (["--job.dump_folder", ""], 'config job.dump_folder is empty: name a folder for the run ("." for the current one)'),
    (["--job.dump_folder", "  "], 'config job.dump_folder is empty: name a folder for the run ("." for the current one)'),
])
def test_a_setting_that_would_do_nothing_or_write_elsewhere_is_one_line(flags: list[str], line: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_args(["--job.config_file", CONFIG, *flags])
    assert str(err.value) == line
    # Controls: with the fingerprints on, the module step is taken; "." names the current folder.
    assert parse_args(["--job.config_file", CONFIG, "--debug.fingerprint_modules_at_step", "3",
                       "--debug.tensor_fingerprint"]).debug.fingerprint_modules_at_step == 3
    assert parse_args(["--job.config_file", CONFIG, "--debug.fingerprint_optimizer_every_step",
                       "--debug.tensor_fingerprint"]).debug.fingerprint_optimizer_every_step
    assert parse_args(["--job.config_file", CONFIG, "--job.dump_folder", "."]).job.dump_folder == "."
