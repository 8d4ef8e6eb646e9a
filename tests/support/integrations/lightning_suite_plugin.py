"""pytest plugin: Lightning's own tests run with an ``ExactResumeCallback`` in every ``Trainer`` they build,
added as a user adds it (``callbacks=[..., ExactResumeCallback()]``).

No package registry carries Lightning's tests (docs/integrations.md says what was checked), so neither the
suite nor CI can run them; with a checkout of Lightning at the installed version (its ``tests`` folder, and
its test requirements cloudpickle, jsonargparse[signatures], tensorboardX), from that folder:

    PYTHONPATH=<this repository> python -m pytest -p tests.support.integrations.lightning_suite_plugin \\
        tests_pytorch/checkpointing tests_pytorch/trainer/connectors/test_checkpoint_connector.py ...

Without ``-p ...`` the same command runs them stock.

Lightning 2.6.6 with the 2.6.5 tests (checkpointing/ but test_legacy_checkpoints.py, which needs downloaded
checkpoints; trainer/connectors/test_checkpoint_connector.py; loops/test_loops.py, test_loop_state_dict.py,
test_training_epoch_loop.py; 240 tests): stock 235 pass and 5 skip; with the callback 221 pass, 5 skip and these
14 fail. (With tensorboard installed, test_local_cross_device_checkpoint and test_ckpt_for_fsspec can end in a
teardown error in both: the logger's event files left in the in-memory filesystem.)

* test_load_with_inf_data_loader, test_fit_loop_save_and_restore_dataloaders (6),
  test_training_loop_dataloader_iter_multiple_dataloaders, test_resume_mid_epoch_warning: they train from an
  IterableDataset, their own (stateful or not) iterables, or two loaders, which the callback refuses at
  fit() start (it cannot make them exact); the last also asserts the "not resumable" warning of such a resume.
* test_workers_are_shutdown (4): they count the worker shutdowns of their own DataLoader subclass; the callback
  refuses a subclass (its additions would be lost) and keeps its own loader's workers across epochs, which is
  what carries their streams.
* test_model_checkpoint_no_extraneous_invocations: it counts every ``torch.save`` call on rank 1 and expects
  none; the callback gathers the ranks' loader states with ``all_gather_object``, whose pickling of tensors
  calls ``torch.save`` in memory (no file is written).
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
