"""signals.handling(): the checkpoint signals are handled inside the block only, flags start clear, the
handlers found on entry are back on exit, and a signal the block did not act on goes to them on exit (or
is left for the caller with redeliver=False). In-process: the handlers found on entry are the test's own."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from types import FrameType

import pytest

from torchtitan_rng import signals


@pytest.fixture
def outside() -> Iterator[list[int]]:
    """A handler of the test's own on SIGUSR1 and SIGTERM, recording what reaches it."""
    seen: list[int] = []

    def record(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)

    previous = {signum: signal.signal(signum, record) for signum in (signal.SIGUSR1, signal.SIGTERM)}
    yield seen
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def test_a_signal_acted_on_stays_inside(outside: list[int]) -> None:
    handler = signal.getsignal(signal.SIGTERM)
    with signals.handling():
        assert signals.received() is None
        signal.raise_signal(signal.SIGTERM)
        assert signals.received() == "SIGTERM" and outside == []
        signals.acknowledge()
    assert signal.getsignal(signal.SIGTERM) is handler and outside == []
    with signals.handling():  # a second block starts unsignalled
        assert signals.received() is None
    signal.raise_signal(signal.SIGTERM)  # outside: the handler found before
    assert outside == [signal.SIGTERM]


def test_a_signal_not_acted_on_goes_to_the_handler_found_before(outside: list[int]) -> None:
    with signals.handling():
        signal.raise_signal(signal.SIGUSR1)
    assert outside == [signal.SIGUSR1] and signals.received() is None


def test_redeliver_later_or_not_at_all_after_an_error(outside: list[int]) -> None:
    with signals.handling(redeliver=False) as scope:
        signal.raise_signal(signal.SIGUSR1)
    assert scope.pending == "SIGUSR1" and outside == []
    scope.redeliver()
    assert outside == [signal.SIGUSR1]
    with pytest.raises(RuntimeError), signals.handling():
        signal.raise_signal(signal.SIGTERM)
        raise RuntimeError("training failed")
    assert outside == [signal.SIGUSR1]  # the error is what the block reports
