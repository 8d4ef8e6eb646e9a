"""The package's folders form layers: no import cycle between its units (a subpackage, or a top-level module),
base modules import only base modules, storage (checkpoint/) imports no policy, and the trainer knows no
parallel mode by name. Read from the source with ``ast``: nothing is imported or run."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.graphs import cycles

PACKAGE = Path(__file__).resolve().parents[2] / "torchtitan_rng"

# Import nothing above themselves: what every layer may use.
BASE = {"errors", "config", "device", "rng", "distributed", "signals", "loss_log"}
# Storage only: the checkpoint layout, reading and writing, vetting; never the trainer's policy or a mode.
STORAGE_MAY_IMPORT = {"errors", "device", "rng", "distributed"}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every torchtitan_rng module that ``path`` imports (at any depth of the file, lazy imports included)."""
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # ``from torchtitan_rng import signals`` imports the module torchtitan_rng.signals.
            found.update(f"{base}.{alias.name}" for alias in node.names if base == "torchtitan_rng")
            found.add(base)
    return {name for name in found if name == "torchtitan_rng" or name.startswith("torchtitan_rng.")}


def unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        source = _unit(_module_of(path))
        graph.setdefault(source, set()).update(
            _unit(name) for name in _imports(path) if name != "torchtitan_rng" and _unit(name) != source)
    return graph


def test_no_cycle_between_units() -> None:
    assert cycles(unit_graph()) == []


def test_cycle_finder_catches_a_cycle() -> None:
    """Control: the finder reports a cycle where there is one (the shape the package used to have)."""
    assert cycles({"checkpoint": {"config"}, "config": {"checkpoint"}, "trainer": {"config"}}) == [
        ["checkpoint", "config"]]


def test_base_modules_import_only_base_modules() -> None:
    graph = unit_graph()
    above = {unit: sorted(graph.get(unit, set()) - BASE) for unit in BASE}
    assert above == {unit: [] for unit in BASE}


def test_storage_imports_no_policy() -> None:
    assert sorted(unit_graph()["checkpoint"] - STORAGE_MAY_IMPORT) == []


def test_the_trainer_and_its_resume_know_no_mode_by_name() -> None:
    for name in ("trainer.py", "resume.py", "build.py", "diagnosis/fingerprints.py"):
        assert "invariant" not in (PACKAGE / name).read_text(), name
