"""The integrations' run scripts (one process of a test run each) and what they need."""

# The framework a run script's processes import before they train, by script module: the warm server of its
# runs imports it once (tests/support/launch.py's ``preload``) instead of every rank of every run.
PRELOAD = {"tests.support.integrations.hf_run": ("transformers.trainer",),
           "tests.support.integrations.hf_prints": ("transformers.trainer",),
           "tests.support.integrations.lightning_run": ("lightning.pytorch",),
           "tests.support.integrations.lightning_prints": ("lightning.pytorch",)}
