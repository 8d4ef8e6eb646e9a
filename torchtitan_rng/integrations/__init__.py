"""Exact resume inside trainers people already use: ``hf`` (transformers.Trainer), ``lightning`` and
``torchtitan`` (torchtitan 0.3's own trainer, as an override).

Importing this package imports neither framework; each submodule imports its own (extras ``hf`` and
``lightning``) and warns once when the installed version is not the one the integration was tested with.
"""

from __future__ import annotations

import importlib.metadata
import warnings

# Distribution -> the release series the integrations are tested against (pyproject extras pin the same).
TESTED_VERSIONS: dict[str, str] = {"transformers": "5.23", "accelerate": "1.15", "lightning": "2.6",
                                   "torchtitan": "0.3"}


def check_tested_version(distribution: str) -> None:
    """One warning line when ``distribution`` is not of the tested series: the integration overrides
    private hooks of the framework, which other releases may move."""
    tested = TESTED_VERSIONS[distribution]
    installed = importlib.metadata.version(distribution)
    if installed != tested and not installed.startswith(tested + "."):
        warnings.warn(
            f"torchtitan_rng.integrations is tested with {distribution} {tested}.x and found {installed}: "
            f"check that resumed runs match (python -m pip install '{distribution}=={tested}.*' for the tested one)",
            stacklevel=3,
        )
