"""The check at save of the trainer and of the torchtitan plug-in: the ranks of each group that must draw the same
masks (tensor parallel; in the plug-in also context parallel and HSDP's replicate dimension) hold the same mask
streams (the gathers run in the launches of tests/e2e/test_tensor_parallel.py, tests/e2e/test_torchtitan_plugin.py
and tests/e2e/test_torchtitan_layouts.py)."""

from __future__ import annotations

from torchtitan_rng.rng import mask_group_mismatch


def test_equal_mask_streams_say_nothing_and_python_streams_do_not_count() -> None:
    same = {"torch_cpu": "a1", "device": "d1"}
    assert mask_group_mismatch(2, [0, 1], [same, dict(same)]) is None
    # Python's and NumPy's streams draw no masks (torchtitan does not even seed Python's alike): not compared.
    assert mask_group_mismatch(2, [0, 1], [{**same, "python": "p0"}, {**same, "python": "p1"}]) is None


def test_different_mask_streams_are_named_with_the_group_the_ranks_and_the_streams() -> None:
    streams = [{"torch_cpu": "a1", "device": "d1"}, {"torch_cpu": "b2", "device": "d1"}]
    assert mask_group_mismatch(4, [2, 3], streams) == (
        "at step 4 the ranks of a tensor-parallel group hold different torch_cpu random streams (rank 2: a1; rank 3: "
        "b2): a dropout in a region they replicate draws another mask on each rank; each rank's streams are saved as "
        "they are, so the resume stays exact")
    assert mask_group_mismatch(4, [0, 2], streams, "replicate (HSDP)") == (
        "at step 4 the ranks of a replicate (HSDP) group hold different torch_cpu random streams (rank 0: a1; rank 2: "
        "b2): the replicas no longer draw as each other; each rank's streams are saved as they are, so the resume "
        "stays exact")
