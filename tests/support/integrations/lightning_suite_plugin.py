"""pytest plugin: Lightning's own tests run with an ``ExactResumeCallback`` in every ``Trainer`` they build,
added as a user adds it (``callbacks=[..., ExactResumeCallback()]``).

Lightning's tests are not in its sdist or wheel, so the suite cannot fetch them from the package registry;
with a checkout of Lightning at the installed version (its ``tests`` folder), from that folder:

    PYTHONPATH=<this repository> python -m pytest -p tests.support.integrations.lightning_suite_plugin \\
        tests_pytorch/checkpointing tests_pytorch/trainer/connectors/test_checkpoint_connector.py ...

Without ``-p ...`` the same command runs them stock.
"""

import functools
from typing import Any

import lightning.pytorch as L

from torchtitan_rng.integrations.lightning import ExactResumeCallback

_stock_init = L.Trainer.__init__


@functools.wraps(_stock_init)
def _with_exact_resume(self: L.Trainer, *args: Any, callbacks: Any = None, **kwargs: Any) -> None:
    given = [] if callbacks is None else list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    _stock_init(self, *args, callbacks=[*given, ExactResumeCallback()], **kwargs)


L.Trainer.__init__ = _with_exact_resume  # type: ignore[method-assign]
