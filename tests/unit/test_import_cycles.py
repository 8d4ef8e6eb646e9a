"""No import cycle between torchtitan_rng's modules: module by module (not folder by folder), counting every
import of one of them wherever it stands — at the top, or deferred inside a function, which only hides a
cycle until that function runs. Only imports under ``if TYPE_CHECKING:`` (never executed) are left out."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.graphs import cycles as components

ROOT = Path(__file__).resolve().parents[2]
# Cycles allowed by name (each a sorted tuple of modules, with the reason): none.
ALLOWED: dict[tuple[str, ...], str] = {}


def _modules(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root`` by dotted name (a package by its own name)."""
    found = {}
    for path in sorted((root / "torchtitan_rng").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` imports, anywhere in it (TYPE_CHECKING blocks aside)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:  # "from pkg import module" imports the module, else pkg itself
                target = f"{base}.{alias.name}"
                if target in modules:
                    found.add(target)
                elif base in modules:
                    found.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    found.discard(name)
    return found


def cycles(root: Path) -> list[tuple[str, ...]]:
    """Every set of modules that import each other in a circle (the graph's strongly connected components of
    more than one module), each sorted."""
    modules = _modules(root)
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    return sorted(tuple(component) for component in components(graph))


def test_no_module_imports_itself_through_others() -> None:
    assert [cycle for cycle in cycles(ROOT) if cycle not in ALLOWED] == []


def test_control_a_cycle_deferred_inside_a_function_is_found(tmp_path: Path) -> None:
    """The check sees what the test above needs it to: a circle closed by an import inside a function, and one
    closed by a relative import inside a sub-package; not one closed only under TYPE_CHECKING."""
    package = tmp_path / "torchtitan_rng"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from torchtitan_rng.sub import c\n")
    (package / "a.py").write_text("from torchtitan_rng import b\n")
    (package / "b.py").write_text("def later():\n    from torchtitan_rng.a import x\n")
    (package / "sub" / "c.py").write_text("from torchtitan_rng.sub import d\n")
    (package / "sub" / "d.py").write_text("from . import c\n")
    (package / "e.py").write_text("from typing import TYPE_CHECKING\n"
                                  "if TYPE_CHECKING:\n    from torchtitan_rng import f\n")
    (package / "f.py").write_text("from torchtitan_rng import e\n")
    assert cycles(tmp_path) == [("torchtitan_rng.a", "torchtitan_rng.b"),
                                ("torchtitan_rng.sub.c", "torchtitan_rng.sub.d")]


def test_the_safe_loader_is_a_leaf() -> None:
    """safe_load.py (the ``.metadata`` unpickler, the weights-only planner) imports nothing of the package but its
    errors: every reader builds on it, so it must never sit inside a circle of the checkpoint code."""
    modules = _modules(ROOT)
    name = "torchtitan_rng.checkpoint.safe_load"
    assert _imports(name, modules[name], modules) <= {"torchtitan_rng.errors"}
