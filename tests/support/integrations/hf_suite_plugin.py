"""pytest plugin: transformers' own Trainer tests run with ``ExactResumeTrainer`` wherever they build a
``transformers.Trainer`` (``from transformers import Trainer`` after this plugin loads gets it).

No package registry carries transformers' trainer tests (docs/integrations.md says what was checked), so
neither the suite nor CI can run them; with a checkout of transformers at the installed version (tests/trainer),
from this repository's root:

    PYTHONPATH=. python -m pytest -p tests.support.integrations.hf_suite_plugin \\
        <transformers>/tests/trainer/test_trainer_checkpointing.py

Without ``-p ...`` the same command runs them stock.
"""

from torchtitan_rng.integrations.hf import ExactResumeTrainer

import transformers  # bound after the integration: importing transformers.trainer replaces sys.modules["transformers"]

transformers.Trainer = ExactResumeTrainer
