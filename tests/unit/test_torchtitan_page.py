"""docs/torchtitan.md's commands for accelerators, read by torchtitan's own config parser (``ConfigManager``, what
``torchtitan.train`` runs first), and the install line's extra: what the page prints must be what torchtitan
accepts and what a run needs. The page's CPU commands run as printed in tests/e2e/test_docs_commands.py.

Each block runs in bash exactly as printed, with ``torchrun`` and ``python`` shell functions that record their
arguments instead of starting anything."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.doc_commands import block_after
from tests.support.launch import REPO

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                reason="torchtitan is not installed (pip install -e '.[torchtitan]')")

PAGE = "torchtitan.md"
PLUGIN = "torchtitan_rng.integrations.torchtitan.exact_resume"
RECIPES = {"llama3": "On accelerators, llama3:", "flux": "Flux (torchtitan's `flux_dev`"}
_RECORD = ('torchrun() { printf "%s\\037" torchrun "$@"; printf "\\036"; }\n'
           'python() { printf "%s\\037" python "$@"; printf "\\036"; }\n')


def recorded_calls(block: str) -> list[list[str]]:
    """The ``torchrun`` and ``python`` commands ``block`` runs, each as its argument list (bash expands them)."""
    proc = subprocess.run(["bash", "-e", "-c", _RECORD + block], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [call.split("\x1f")[:-1] for call in proc.stdout.split("\x1e")[:-1]]


def diff_command(page: str) -> str:
    """The command of the page's first ```diff block with its changes applied (the ``+`` lines kept)."""
    text = (REPO / "docs" / page).read_text()
    diff = re.search(r"```diff\n(.*?)```", text, re.S)
    assert diff is not None, f"no diff block in {page}"
    return "".join(line[1:] + "\n" for line in diff.group(1).splitlines() if not line.startswith("-"))


def torchtitan_args(call: list[str]) -> list[str]:
    """The arguments torchtitan's entry point gets from a ``torchrun ... -m torchtitan.train ARGS`` call."""
    assert call[0] == "torchrun" and "-m" in call, call
    module = call.index("-m")
    assert call[module + 1] == "torchtitan.train", call
    return call[module + 2:]


@pytest.fixture(scope="module")
def parse() -> Any:
    """torchtitan's own parser; its models import Triton kernels, which a CPU-only machine lacks: there the CPU
    example's stand-in module (examples/torchtitan_cpu/cpu_adjustments.py) lets them import, nothing else."""
    if importlib.util.find_spec("triton") is None:
        spec = importlib.util.spec_from_file_location(
            "cpu_adjustments", REPO / "examples" / "torchtitan_cpu" / "cpu_adjustments.py")
        adjustments = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(adjustments)
        adjustments.stub_moe_kernels()
    from torchtitan.config import ConfigManager

    return lambda args: ConfigManager().parse_args(args)


def plugged_in(config: Any) -> list[str]:
    """What torchtitan's overrides replace in ``config`` (as the trainer applies them before it builds)."""
    from torchtitan.config.override import apply_overrides

    return apply_overrides(config.override, config)


def swaps_the_checkpoint_manager(config: Any) -> bool:
    return any(" checkpoint CheckpointManager.Config -> " in line for line in plugged_in(config))


@pytest.mark.parametrize("model", list(RECIPES))
def test_recipe_commands_parse_seeded_with_the_plugin(parse: Any, model: str) -> None:
    # "Turn it on": the one flag on a stock command.
    [call] = recorded_calls(diff_command(PAGE))
    turned_on = parse(torchtitan_args(call))
    assert turned_on.checkpoint.enable and swaps_the_checkpoint_manager(turned_on), turned_on.override
    # The recipe for this model.
    calls = recorded_calls(block_after(PAGE, RECIPES[model]))
    runs = [call for call in calls if call[0] == "torchrun"]
    assert len(runs) == 3, calls  # uninterrupted, stopped, resumed
    configs = [parse(torchtitan_args(call)) for call in runs]
    # One seed, set in every command: unseeded, torchtitan draws one per run and the runs differ from step 1.
    seeds = {config.debug.seed for config in configs}
    assert len(seeds) == 1 and None not in seeds, seeds
    assert all(config.model_spec.name == model and config.checkpoint.enable for config in configs)
    assert all(swaps_the_checkpoint_manager(config) for config in configs)
    # The uninterrupted run and the stopped one (its stop, then its resume in the same folder) are compared.
    uninterrupted, stopped, resumed = configs
    assert stopped.dump_folder == resumed.dump_folder != uninterrupted.dump_folder
    assert stopped.training.steps < resumed.training.steps == uninterrupted.training.steps
    compared = [call for call in calls if call[:3] == ["python", "-m", "torchtitan_rng.compare_losses"]]
    assert compared and all(call[3:5] == [uninterrupted.dump_folder, resumed.dump_folder] for call in compared)


def test_an_unseeded_recipe_is_caught(parse: Any) -> None:
    """Control: the page's recipe without its seed parses to no seed, which the test above refuses."""
    block = block_after(PAGE, RECIPES["llama3"]).replace(" --debug.seed 7", "")
    call = next(call for call in recorded_calls(block) if call[0] == "torchrun")
    assert parse(torchtitan_args(call)).debug.seed is None


# Imported by transformers when it reads a T5 tokenizer shipped as spiece.model (flux_dev's google/t5-v1_1-xxl):
# without it, loading fails ("Falling back to TikToken extractor" ... "tiktoken is required").
_LAZY = {"sentencepiece"}


def _imported_distributions(package: Path) -> set[str]:
    """The distributions whose modules the package's source imports (standard library and itself left out)."""
    from importlib.metadata import packages_distributions

    owners = packages_distributions()
    names = set()
    for source in package.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    names -= set(sys.stdlib_module_names) | {"torchtitan"}
    return {_canonical(owners[name][0]) for name in names if name in owners}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed_by(requirements: list[str]) -> set[str]:
    """The distributions these requirements install, with everything they require in turn (as installed here;
    a requirement not installed here counts by its name)."""
    from importlib.metadata import PackageNotFoundError, requires
    from packaging.requirements import Requirement

    found: set[str] = set()
    todo = [Requirement(text) for text in requirements]
    while todo:
        requirement = todo.pop()
        name = _canonical(requirement.name)
        if name in found or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        found.add(name)
        try:
            todo.extend(Requirement(text) for text in requires(requirement.name) or [])
        except PackageNotFoundError:
            pass
    return found


def _extra(name: str) -> list[str]:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"][name]]


def test_the_torchtitan_extra_installs_what_flux_imports() -> None:
    import torchtitan

    flux = Path(torchtitan.__file__).parent / "models" / "flux"
    imported = _imported_distributions(flux) | _LAZY
    assert "transformers" in imported  # the scan sees Flux's own imports
    assert imported - _installed_by(_extra("torchtitan")) == set()
    # Control: torchtitan alone (the extra as it was) leaves transformers and sentencepiece out.
    assert imported - _installed_by(["torchtitan==0.3.*"]) >= {"transformers", "sentencepiece"}
