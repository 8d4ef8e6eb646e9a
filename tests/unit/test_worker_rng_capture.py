"""The packed worker-RNG state: one capture puts back Python's, NumPy's and torch's CPU streams exactly,
cached gaussians included, also after a round trip through the checkpoint codec."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from torchtitan_rng.checkpoint.codec import decode_state, encode_state
from torchtitan_rng.data.worker_rng import _HEADER, _numpy_stream, capture_worker_rng, restore_worker_rng
from torchtitan_rng.rng import preserved_global_rng


def draws() -> bytes:
    """Bits of the next values of every stream, gaussians first (they use the cached halves)."""
    values = [np.random.randn(3), np.array([random.gauss(0, 1), random.random()]), np.random.rand(2)]
    return b"".join(value.tobytes() for value in values) + torch.rand(4).numpy().tobytes()


@pytest.fixture
def cached_gaussians() -> Iterator[None]:
    """Every stream somewhere past its seed, NumPy and Python each holding a cached gaussian (the test
    process's streams are put back afterwards)."""
    with preserved_global_rng(torch.device("cpu")):
        random.seed(1)
        np.random.seed(2)
        torch.manual_seed(3)
        np.random.randn()  # an odd count of legacy gaussians leaves one cached
        random.gauss(0, 1)  # Python caches the second value of its pair
        torch.rand(5)
        yield


def without_cached_gaussians(packed: bytes) -> bytes:
    version, _, _, pos, _, _ = _HEADER.unpack_from(packed)
    return _HEADER.pack(version, False, 0.0, pos, False, 0.0) + packed[_HEADER.size:]


def test_restore_puts_every_stream_back(cached_gaussians: None) -> None:
    packed = capture_worker_rng()
    assert isinstance(packed, bytes)
    expected = draws()
    restore_worker_rng(decode_state(encode_state({"worker_rng": packed}))["worker_rng"])
    assert draws() == expected


def test_control_a_capture_without_the_cached_gaussians_differs(cached_gaussians: None) -> None:
    """The comparison above can fail: dropping the cached gaussians changes the next draws."""
    packed = capture_worker_rng()
    expected = draws()
    restore_worker_rng(without_cached_gaussians(packed))
    assert draws() != expected


@pytest.mark.parametrize("form", ["uint8 array", "uint8 tensor"])
def test_a_packed_array_from_an_older_checkpoint_restores(cached_gaussians: None, form: str) -> None:
    packed = capture_worker_rng()
    expected = draws()
    array = np.frombuffer(packed, dtype=np.uint8)
    restore_worker_rng(array if form == "uint8 array" else torch.from_numpy(array.copy()))
    assert draws() == expected


def test_the_codec_keeps_bytes_beside_tensors() -> None:
    state = {"a": b"\x00\x01raw", "t": torch.arange(3), "empty": b"", "n": (1, b"x")}
    decoded = decode_state(encode_state(state))
    assert decoded["a"] == b"\x00\x01raw" and decoded["empty"] == b"" and decoded["n"] == (1, b"x")
    assert torch.equal(decoded["t"], torch.arange(3))


def test_numpy_reading_matches_get_state_through_every_kind_of_move() -> None:
    """The fast reading of NumPy's global stream (C state and cached gaussian) is what get_state() says,
    after draws, odd and even gaussians, seeding and set_state with a cached gaussian."""
    with preserved_global_rng(torch.device("cpu")):
        readings = _readings_after_moves()
    assert _numpy_stream.fast  # the fast path ran here, not the fallback
    assert len(set(readings)) > 5  # the moves changed what was read (the comparison can fail)


def _readings_after_moves() -> list[tuple[bytes, int, int, float]]:
    stream = _numpy_stream
    moves = [lambda: np.random.rand(700), lambda: np.random.randn(), lambda: np.random.randn(2),
             lambda: np.random.seed(5),
             lambda: np.random.set_state(("MT19937", np.arange(624, dtype=np.uint32), 17, 1, -0.25))]
    readings = []
    for move in moves * 3:
        move()
        readings.append(stream.read())
        assert readings[-1] == stream._slow(np.random.mtrand._rand)
    return readings
