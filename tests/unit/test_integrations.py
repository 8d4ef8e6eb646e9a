"""The framework integrations stay optional: importing the package imports neither transformers nor Lightning."""

from __future__ import annotations

import subprocess
import sys

from tests.support.launch import REPO, run_env


def test_importing_the_package_imports_no_framework() -> None:
    code = ("import sys, torchtitan_rng, torchtitan_rng.integrations, torchtitan_rng.integrations.loader; "
            "assert not {'transformers', 'accelerate', 'lightning', 'torchtitan'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, env=run_env())
