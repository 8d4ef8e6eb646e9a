"""StopVote: ranks agree on a stop at the same boundary, one poll after the first rank's flag, with a vote
that is cast at one poll and read at the next."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.ranks import end_rank

from torchtitan_rng.distributed import StopVote

WORLD = 2
POLLS = 6


def _vote(rank: int, folder: Path, signalled_rank: int, signal_at: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder / 'store'}", rank=rank, world_size=WORLD)
    vote = StopVote()
    # The signalled rank's flag stays set from poll signal_at on, as signals.received() does.
    seen = [vote.poll(rank == signalled_rank and poll >= signal_at) for poll in range(POLLS)]
    vote.close()
    (folder / f"rank{rank}.json").write_text(json.dumps(seen))
    end_rank()


def _polls(folder: Path, signalled_rank: int, signal_at: int) -> list[list[bool]]:
    mp.spawn(_vote, args=(folder, signalled_rank, signal_at), nprocs=WORLD, join=True)
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def test_every_rank_stops_one_poll_after_the_signal_on_one_rank(tmp_path: Path) -> None:
    seen = _polls(tmp_path, signalled_rank=1, signal_at=2)
    expected = [poll > 2 for poll in range(POLLS)]
    assert seen == [expected, expected]  # rank 0 never had the flag: only the vote tells it


def test_control_without_a_signal_nobody_stops(tmp_path: Path) -> None:
    assert _polls(tmp_path, signalled_rank=1, signal_at=POLLS) == [[False] * POLLS] * WORLD


def test_alone_the_flag_is_the_vote() -> None:
    vote = StopVote()
    assert [vote.poll(flag) for flag in (False, True, False)] == [False, True, False]
    assert vote.close() is False  # nothing in flight
