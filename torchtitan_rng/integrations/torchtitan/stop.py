"""Stop signals: a signal only sets a flag; the ranks agree on the step to stop at (one CPU all-reduce per step,
read a step later), so every rank saves a full checkpoint at the same step."""

from __future__ import annotations

from torchtitan_rng import signals as checkpoint_signals
from torchtitan_rng.distributed import StopVote


class SignalStop:
    """The run's stop signals and the ranks' vote on them. A collective: every rank builds one at the same
    point (the checkpoint manager's construction)."""

    def __init__(self, names: list[str]) -> None:
        checkpoint_signals.install(names)
        self._vote: StopVote | None = StopVote()

    def agreed(self) -> bool:
        """At a step boundary: whether the ranks have agreed to stop here (a rank's signal counts a step
        later on every rank)."""
        assert self._vote is not None, "the stop vote is closed"
        return self._vote.poll(checkpoint_signals.received() is not None)

    def close(self) -> None:
        """Finish the vote in flight (every rank has one) before the process group goes."""
        if self._vote is not None:
            self._vote.close()
            self._vote = None
