"""The torchtitan plug-in's check at save: the ranks of each group that must draw the same masks (tensor parallel,
context parallel, HSDP's replicate dimension) hold the same mask streams (the gathers run in the launches of
tests/e2e/test_torchtitan_plugin.py and tests/e2e/test_torchtitan_layouts.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")


def test_equal_mask_streams_say_nothing_and_python_streams_do_not_count() -> None:
    from torchtitan_rng.integrations.torchtitan import mask_group_mismatch

    same = {"torch_cpu": "a1", "device": "d1"}
    assert mask_group_mismatch(2, "tensor-parallel", [0, 1], [same, dict(same)]) is None
    # Python's and NumPy's streams draw no masks (torchtitan does not even seed Python's alike): not compared.
    python_differs = [{**same, "python": "p0"}, {**same, "python": "p1"}]
    assert mask_group_mismatch(2, "tensor-parallel", [0, 1], python_differs) is None


def test_different_mask_streams_are_named_with_the_ranks_and_the_streams() -> None:
    from torchtitan_rng.integrations.torchtitan import mask_group_mismatch

    line = mask_group_mismatch(4, "context-parallel", [2, 3], [{"torch_cpu": "a1", "device": "d1"},
                                                               {"torch_cpu": "b2", "device": "d1"}])
    assert line == ("torchtitan_rng: at step 4 the ranks of a context-parallel group hold different torch_cpu random "
                    "streams (rank 2: a1; rank 3: b2): they no longer draw the same dropout masks; each rank's streams "
                    "are saved as they are, so the resume stays exact")
