"""The override's options (``--override.imports 'TARGET={"signals": [...]}'``), checked as the user wrote them:
torchtitan hands them to the override as keyword arguments, unchecked."""

from __future__ import annotations

import difflib
import json
from typing import Any

from torchtitan_rng import signals as checkpoint_signals
from torchtitan_rng.errors import ConfigError

# Each option and the values it takes (what ExactResumeCheckpointManager.Config declares).
RESTORE_POINTS = ("first_iter", "load")
OPTIONS = ("signals", "restore_streams_at", "worker_streams", "tensor_fingerprint", "fingerprint_modules_at_step",
           "fingerprint_optimizer_every_step")


def _shown(value: Any) -> str:
    """A value as the user wrote it (JSON, the form of the override's options)."""
    return json.dumps(value, default=repr)


def check_options(options: dict[str, Any]) -> None:
    """ConfigError naming the first option, as written, whose key or value is not one the plug-in takes."""
    for key, value in options.items():
        where = f"exact_resume option {_shown(key)}"
        if key not in OPTIONS:
            close = difflib.get_close_matches(key, OPTIONS, n=1)
            hint = f"did you mean {_shown(close[0])}? " if close else ""
            raise ConfigError(f"exact_resume has no option {_shown(key)}: {hint}its options are "
                              f"{', '.join(OPTIONS)}")
        if key == "signals":
            if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
                raise ConfigError(f"{where} is {_shown(value)}, not a list of signal names: write it as "
                                  f"{{\"signals\": [\"SIGTERM\", \"SIGUSR1\"]}}")
            checkpoint_signals.signal_numbers(value, where)
        elif key == "restore_streams_at" and value not in RESTORE_POINTS:
            raise ConfigError(f"{where} is {_shown(value)}; use \"first_iter\" (exact) or \"load\"")
        elif (key in ("worker_streams", "tensor_fingerprint", "fingerprint_optimizer_every_step")
              and not isinstance(value, bool)):
            raise ConfigError(f"{where} is {_shown(value)}, not true or false")
        elif key == "fingerprint_modules_at_step" and (not isinstance(value, int) or isinstance(value, bool)
                                                       or value < 0):
            raise ConfigError(f"{where} is {_shown(value)}, not a step number (0: no step)")
    for key, what in (("fingerprint_modules_at_step", "module calls"),
                      ("fingerprint_optimizer_every_step", "the optimizer state")):
        if options.get(key) and options.get("tensor_fingerprint") is not True:
            raise ConfigError(f"exact_resume option \"{key}\" hashes {what} into the tensor fingerprints: add "
                              "\"tensor_fingerprint\": true")
