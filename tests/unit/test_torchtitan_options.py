"""The torchtitan plug-in's options (``--override.imports 'torchtitan_rng.integrations.torchtitan.exact_resume=
{...}'``): torchtitan hands them to the override unchecked, so the override checks each one, names it as the user
wrote it in one line (rank 0's) and exits 2, with no traceback. The launch through torchrun:
tests/e2e/test_torchtitan_plugin.py."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torchtitan")

BAD = {
    "an unknown restore point": ({"restore_streams_at": "LOAD"},
                                 'exact_resume option "restore_streams_at" is "LOAD"; use "first_iter" (exact) or '
                                 '"load"'),
    "a misspelt key": ({"restore_stream_at": "load"},
                       'exact_resume has no option "restore_stream_at": did you mean "restore_streams_at"? its '
                       "options are signals, restore_streams_at, worker_streams"),
    "an uncatchable signal": ({"signals": ["SIGKILL"]},
                              "exact_resume option \"signals\" has 'SIGKILL': not a signal a run can checkpoint on"),
    "a string for the list": ({"signals": "SIGTERM"},
                              'exact_resume option "signals" is "SIGTERM", not a list of signal names: write it as '
                              '{"signals": ["SIGTERM", "SIGUSR1"]}'),
    "a number for a signal": ({"signals": [15]},
                              'exact_resume option "signals" is [15], not a list of signal names'),
    "a word for a flag": ({"worker_streams": "no"}, 'exact_resume option "worker_streams" is "no", not true or false'),
    "a misspelt fingerprint key": ({"tensor_fingerprints": True},
                                   'exact_resume has no option "tensor_fingerprints": did you mean '
                                   '"tensor_fingerprint"?'),
    "a number for the fingerprint flag": ({"tensor_fingerprint": 1},
                                          'exact_resume option "tensor_fingerprint" is 1, not true or false'),
    "a negative module step": ({"tensor_fingerprint": True, "fingerprint_modules_at_step": -1},
                               'exact_resume option "fingerprint_modules_at_step" is -1, not a step number (0: no '
                               'step)'),
    "a string for the module step": ({"tensor_fingerprint": True, "fingerprint_modules_at_step": "3"},
                                     'exact_resume option "fingerprint_modules_at_step" is "3", not a step number'),
    "a module step without fingerprints": ({"fingerprint_modules_at_step": 3},
                                           'exact_resume option "fingerprint_modules_at_step" hashes module calls '
                                           'into the tensor fingerprints: add "tensor_fingerprint": true'),
    "a module step with fingerprints off": ({"tensor_fingerprint": False, "fingerprint_modules_at_step": 3},
                                            'exact_resume option "fingerprint_modules_at_step" hashes module calls '
                                            'into the tensor fingerprints: add "tensor_fingerprint": true'),
    "a word for the optimizer flag": ({"tensor_fingerprint": True, "fingerprint_optimizer_every_step": "yes"},
                                      'exact_resume option "fingerprint_optimizer_every_step" is "yes", not true or '
                                      'false'),
    "the optimizer every step without fingerprints": ({"fingerprint_optimizer_every_step": True},
                                                      'exact_resume option "fingerprint_optimizer_every_step" hashes '
                                                      'the optimizer state into the tensor fingerprints: add '
                                                      '"tensor_fingerprint": true'),
}


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    # The plug-in's lines (torchtitan's own Config warns of settings it ignores).
    return [record.getMessage() for record in caplog.records
            if record.levelname in ("ERROR", "WARNING") and record.getMessage().startswith("torchtitan_rng:")]


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_option_is_one_line_naming_it_as_written_and_exit_2(case: str,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    from torchtitan.components.checkpointer import CheckpointManager

    from torchtitan_rng.integrations.torchtitan import exact_resume

    options, expected = BAD[case]
    with caplog.at_level("WARNING"), pytest.raises(SystemExit) as stopped:
        exact_resume(CheckpointManager.Config(), **options)
    assert stopped.value.code == 2
    assert stopped.value.__context__ is None or stopped.value.__suppress_context__  # no chained traceback
    [line] = _errors(caplog)
    assert line.startswith("torchtitan_rng: " + expected), line


@pytest.mark.parametrize("options", [{}, {"signals": ["SIGUSR1"]}, {"restore_streams_at": "load"},
                                     {"worker_streams": False}, {"signals": [], "restore_streams_at": "first_iter",
                                                                 "worker_streams": True},
                                     {"tensor_fingerprint": True}, {"tensor_fingerprint": False},
                                     {"tensor_fingerprint": True, "fingerprint_modules_at_step": 4},
                                     {"tensor_fingerprint": False, "fingerprint_modules_at_step": 0},
                                     {"tensor_fingerprint": True, "fingerprint_optimizer_every_step": True}])
def test_good_options_build_the_plugins_config(options: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    from torchtitan.components.checkpointer import CheckpointManager

    from torchtitan_rng.integrations.torchtitan import ExactResumeCheckpointManager, exact_resume

    # The control: the same check lets every value the options take through, silently, into the config.
    with caplog.at_level("WARNING"):
        config = exact_resume(CheckpointManager.Config(interval=7), **options)
    assert type(config) is ExactResumeCheckpointManager.Config and config.interval == 7
    assert all(getattr(config, key) == value for key, value in options.items())
    assert not _errors(caplog)


def test_a_config_built_in_code_is_checked_the_same_way() -> None:
    from torchtitan_rng.errors import ConfigError
    from torchtitan_rng.integrations.torchtitan import ExactResumeCheckpointManager

    with pytest.raises(ConfigError, match='option "worker_streams" is "no", not true or false'):
        ExactResumeCheckpointManager.Config(worker_streams="no")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match='add "tensor_fingerprint": true'):
        ExactResumeCheckpointManager.Config(fingerprint_modules_at_step=2)
