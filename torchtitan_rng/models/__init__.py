"""The built-in train specs (importing this package registers ``llama`` and ``flux``) and the look-up of the
spec a config names, after importing the user module that may register its own (``job.custom_module``)."""

from __future__ import annotations

import importlib
import traceback
from pathlib import Path

from torchtitan_rng.config import JobConfig
from torchtitan_rng.errors import ConfigError
from torchtitan_rng.models import flux, llama  # noqa: F401  (registers the built-in specs)
from torchtitan_rng.train_spec import TrainSpec, registered_specs


def _registered_names() -> str:
    return ", ".join(sorted(registered_specs())) or "none"


def _import_custom_module(name: str) -> None:
    """Import ``job.custom_module``; any failure is a user error reported in one line."""
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and (name == err.name or name.startswith(err.name + ".")):
            raise ConfigError(
                f"job.custom_module {name!r} not found: no module {err.name!r} on the Python path (put the "
                f"folder that holds it on PYTHONPATH); registered model names: {_registered_names()}"
            ) from None
        raise ConfigError(f"job.custom_module {name!r} failed to import: {_one_line(err)}") from None
    except Exception as err:  # whatever the user's module raises
        raise ConfigError(f"job.custom_module {name!r} failed to import: {_one_line(err)}") from None


def _one_line(err: BaseException) -> str:
    """``Type: first line of the message (file:line where it was raised)``."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    # The innermost frame in a real file (importlib's own frames are "<frozen ...>"); a SyntaxError's
    # message already names its file and line.
    frames = [frame for frame in traceback.extract_tb(err.__traceback__) if not frame.filename.startswith("<")]
    if not frames or isinstance(err, SyntaxError):
        return f"{type(err).__name__}: {message}"
    return f"{type(err).__name__}: {message} ({Path(frames[-1].filename).name}:{frames[-1].lineno})"


def get_train_spec(config: JobConfig) -> TrainSpec:
    """The spec for ``model.name``, importing ``job.custom_module`` first if one is given."""
    if config.job.custom_module:
        _import_custom_module(config.job.custom_module)
    if config.model.name not in registered_specs():
        hint = (f"job.custom_module {config.job.custom_module!r} did not register it" if config.job.custom_module
                else "a custom model needs job.custom_module to register it")
        raise ConfigError(
            f"unknown model.name {config.model.name!r}; registered: {_registered_names()} ({hint})"
        )
    return registered_specs()[config.model.name]
