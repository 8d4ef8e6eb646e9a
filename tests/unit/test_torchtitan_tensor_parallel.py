"""The check at save of the trainer and of the torchtitan plug-in: the ranks of a tensor-parallel group hold the
same mask streams (the gather runs in the tensor-parallel launches of tests/e2e/test_torchtitan_plugin.py and
tests/e2e/test_tensor_parallel.py)."""

from __future__ import annotations

from torchtitan_rng.rng import tensor_parallel_mismatch


def test_equal_mask_streams_say_nothing_and_python_streams_do_not_count() -> None:
    same = {"torch_cpu": "a1", "device": "d1"}
    assert tensor_parallel_mismatch(2, [0, 1], [same, dict(same)]) is None
    # Python's and NumPy's streams draw no masks (torchtitan does not even seed Python's alike): not compared.
    assert tensor_parallel_mismatch(2, [0, 1], [{**same, "python": "p0"}, {**same, "python": "p1"}]) is None


def test_different_mask_streams_are_named_with_the_ranks_and_the_streams() -> None:
    line = tensor_parallel_mismatch(4, [2, 3], [{"torch_cpu": "a1", "device": "d1"},
                                                {"torch_cpu": "b2", "device": "d1"}])
    assert line == ("at step 4 the ranks of a tensor-parallel group hold different torch_cpu random "
                    "streams (rank 2: a1; rank 3: b2): a dropout in a region they replicate draws another mask on "
                    "each rank; each rank's streams are saved as they are, so the resume stays exact")
