"""The config reference comes from the schema: every key has a meaning, ``--help`` prints it, and
docs/config.md is what the generator writes."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from tests.support.launch import REPO, run_env
from torchtitan_rng import config_reference
from torchtitan_rng.config import JobConfig, Training, _key, describe_keys

PAGE = REPO / "docs" / "config.md"


def _without_meaning(schema: type) -> list[str]:
    return [key.dotted for key in describe_keys(schema) if not key.meaning.strip()]


def test_every_key_has_a_meaning() -> None:
    assert _without_meaning(JobConfig) == []
    # Control: a key declared the old way (no metadata) is found.
    training = dataclasses.make_dataclass("Training", [("undocumented", int, 0)], bases=(Training,))
    schema = dataclasses.make_dataclass(
        "Schema", [("training", training, dataclasses.field(default_factory=training))], bases=(JobConfig,))
    assert _without_meaning(schema) == ["training.undocumented"]


def test_help_prints_every_key_with_its_meaning_type_and_default() -> None:
    proc = subprocess.run([sys.executable, "-m", "torchtitan_rng.train", "--help"], cwd=REPO, capture_output=True,
                          text=True, env=run_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for key in describe_keys():
        header = next(i for i, line in enumerate(lines) if line.startswith(f"  --{key.dotted} ("))
        assert key.type_name in lines[header] and "default" in lines[header]
        assert all(choice in lines[header] for choice in key.choices)
        # The meaning follows, wrapped over the indented lines below the key.
        following = []
        for line in lines[header + 1:]:
            if not line.startswith("      "):
                break
            following.append(line.strip())
        minimum = f" (at least {key.minimum:g})" if key.minimum is not None else ""
        assert " ".join(following) == key.meaning + minimum, key.dotted


def test_the_page_is_what_the_generator_writes(tmp_path: Path) -> None:
    assert PAGE.read_text() == config_reference.render(), (
        "docs/config.md differs from the schema: run python -m torchtitan_rng.config_reference")
    for key in describe_keys():
        assert f"| `{key.dotted}` |" in PAGE.read_text()
    assert config_reference.main(["--check", str(PAGE)]) == 0
    # Control: a page missing one key's line is stale.
    stale = tmp_path / "config.md"
    stale.write_text("".join(line for line in PAGE.read_text().splitlines(keepends=True)
                             if "`data.shuffle_buffer`" not in line))
    assert config_reference.main(["--check", str(stale)]) == 1
    # The generator rewrites it.
    assert config_reference.main([str(stale)]) == 0 and stale.read_text() == PAGE.read_text()


def test_a_meaning_changed_in_the_schema_changes_the_page() -> None:
    """Control for the comparison above: the page follows the metadata, not a copy of it."""
    field = next(f for f in dataclasses.fields(Training) if f.name == "steps")
    original = field.metadata
    field.metadata = _key(20, "a different meaning").metadata
    try:
        assert config_reference.render() != PAGE.read_text()
    finally:
        field.metadata = original
    assert config_reference.render() == PAGE.read_text()
