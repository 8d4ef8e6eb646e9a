"""The torchtitan plug-in names a resume on another process count or layout: one line, both layouts, the rule
each rank's streams follow (the launches: tests/e2e/test_torchtitan_plugin.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

TWO = {"world_size": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "pp": 1, "ep": 1}
ONE = {"world_size": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1}


def test_fewer_processes_name_the_unused_streams() -> None:
    from torchtitan_rng.integrations.torchtitan import layout_change

    assert layout_change(2, TWO, 1, ONE) == (
        "torchtitan_rng: the checkpoint was saved by 2 processes (dp_shard 2) and this run has 1 process (no "
        "parallelism): rank 0 restores the streams saved by the rank of the same number; the streams saved by "
        "rank 1 are not used; this resume is not exact")


def test_more_processes_name_the_new_ranks_fresh_streams() -> None:
    from torchtitan_rng.integrations.torchtitan import layout_change

    line = layout_change(1, ONE, 2, TWO)
    assert line is not None and "saved by 1 process (no parallelism) and this run has 2 processes (dp_shard 2)" in line
    assert "rank 0 restores the streams saved by the rank of the same number; rank 1, new, keeps the streams " \
           "torchtitan seeded at start" in line
    four = dict(TWO, world_size=4, dp_shard=4)
    assert "ranks 1-3, new, keep the streams" in (layout_change(1, None, 4, four) or "")


def test_same_count_other_layout_is_named_same_layout_is_not() -> None:
    from torchtitan_rng.integrations.torchtitan import layout_change

    tp = dict(TWO, dp_shard=1, tp=2)
    line = layout_change(2, TWO, 2, tp)
    assert line is not None
    assert "2 processes (dp_shard 2) and this run has 2 processes (tp 2): ranks 0-1 restore" in line
    assert layout_change(2, TWO, 2, dict(TWO)) is None
    # A checkpoint from before the layout was recorded: only the counts can be compared.
    assert layout_change(2, None, 2, tp) is None
    assert "2 processes (layout not recorded)" in (layout_change(2, None, 1, ONE) or "")


def test_layout_of_reads_torchtitans_parallel_dims() -> None:
    from torchtitan.distributed.parallel_dims import ParallelDims

    from torchtitan_rng.integrations.torchtitan import describe_layout, layout_of

    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=4)
    assert layout_of(dims) == dict(TWO, world_size=4, tp=2)
    assert describe_layout(4, layout_of(dims)) == "4 processes (dp_shard 2 x tp 2)"


def test_saved_stream_ranks_counts_a_real_checkpoints_rank_keys(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from torchtitan_rng.checkpoint.safe_load import SafeFileSystemReader
    from torchtitan_rng.integrations.torchtitan import saved_stream_ranks

    state = {"torchtitan_rng": {"step": 3, "rank_0": b"a", "rank_1": b"b"}, "train_state": {"step": 3}}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    keys = SafeFileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    assert saved_stream_ranks(keys) == 2
    assert saved_stream_ranks([key for key in keys if not key.startswith("torchtitan_rng.")]) == 0


def _checkpoint(folder: Path, layout: dict[str, int], seeds: list[int]) -> Path:
    """A real DCP checkpoint of the plug-in's streams part as ``len(seeds)`` ranks save it (rank r's streams
    seeded with ``seeds[r]``), with the run record's layout."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torchtitan_rng.checkpoint.run_record import make_record, write_record
    from torchtitan_rng.checkpoint.train_state import TrainState

    part: dict = {}
    for rank, seed in enumerate(seeds):
        torch.manual_seed(seed)
        part.update(TrainState(torch.device("cpu"), rank=rank, world_size=len(seeds)).state_dict())
    dcp.save({"torchtitan_rng": part}, checkpoint_id=str(folder), no_dist=True)
    write_record(folder, dict(make_record({}, None), layout=layout))
    return folder


def _load_as(checkpoint: Path, rank: int, layout: dict[str, int], exclude: tuple[str, ...] = ()) -> object:
    """The plug-in's ``dcp_load`` of ``checkpoint`` as rank ``rank`` of a run with ``layout`` (the manager
    without a trainer: only what ``dcp_load`` reads); the rank's TrainState after the load."""
    import types

    import torch
    from torchtitan.distributed.parallel_dims import ParallelDims

    from torchtitan_rng.checkpoint.train_state import TrainState
    from torchtitan_rng.integrations.torchtitan import ExactResumeCheckpointManager

    manager = ExactResumeCheckpointManager.__new__(ExactResumeCheckpointManager)
    manager.states, manager.exclude_from_loading = {}, list(exclude)
    manager.streams = TrainState(torch.device("cpu"), rank=rank, world_size=layout["world_size"])
    # The record holds no config keys, so the drift check compares none: an empty config stands for the run.
    manager.trainer = types.SimpleNamespace(parallel_dims=ParallelDims(**layout),
                                            config=types.SimpleNamespace(to_dict=dict))
    # torchtitan leaves an excluded part out of what it asks DCP for.
    state = {} if "torchtitan_rng" in exclude else {"torchtitan_rng": manager.streams}
    manager.dcp_load(state, str(checkpoint), from_hf=False, from_quantized=False)
    return manager.streams


def _seeded_by(streams: object, seed: int) -> bool:
    import torch

    torch.manual_seed(seed)
    return torch.equal(streams.loaded["rng"]["torch_cpu"], torch.get_rng_state())  # type: ignore[attr-defined]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.levelname == "WARNING" and record.getMessage().startswith("torchtitan_rng:")]


def test_more_processes_each_rank_loads_its_own_or_none(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    checkpoint = _checkpoint(tmp_path / "one", ONE, seeds=[11])
    with caplog.at_level("WARNING"):
        first = _load_as(checkpoint, 0, TWO)
    [line] = _warnings(caplog)
    assert "saved by 1 process (no parallelism) and this run has 2 processes (dp_shard 2)" in line
    assert _seeded_by(first, 11)
    caplog.clear()
    with caplog.at_level("WARNING"):
        new = _load_as(checkpoint, 1, TWO)
    assert new.loaded is None  # type: ignore[attr-defined]  # keeps the streams seeded at start: not rank 0's
    assert not _warnings(caplog), "only rank 0 names the layouts"
    # Control: without the plug-in's rule the new rank's load fails (DCP: the key is missing).
    import torch

    from torchtitan_rng.checkpoint.train_state import TrainState

    with pytest.raises(CheckpointException):
        dcp.load({"torchtitan_rng": TrainState(torch.device("cpu"), rank=1, world_size=2)},
                 checkpoint_id=str(checkpoint), no_dist=True)


def test_fewer_processes_rank_0_loads_rank_0s_streams(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    checkpoint = _checkpoint(tmp_path / "two", TWO, seeds=[11, 12])
    with caplog.at_level("WARNING"):
        only = _load_as(checkpoint, 0, ONE)
    assert _seeded_by(only, 11) and not _seeded_by(only, 12)
    lines = _warnings(caplog)
    assert len(lines) == 1 and "the streams saved by rank 1 are not used" in lines[0], lines
    # Control: the same layout loads as quietly as it restores rank for rank.
    caplog.clear()
    with caplog.at_level("WARNING"):
        second = _load_as(checkpoint, 1, TWO)
    assert _seeded_by(second, 12) and not _warnings(caplog)


def test_streams_excluded_from_loading_are_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    checkpoint = _checkpoint(tmp_path / "two", TWO, seeds=[11, 12])
    with caplog.at_level("WARNING"):
        streams = _load_as(checkpoint, 0, TWO, exclude=("torchtitan_rng",))
    assert streams.loaded is None  # type: ignore[attr-defined]
    assert _warnings(caplog) == ["torchtitan_rng: --checkpoint.exclude_from_loading names torchtitan_rng: every "
                                 "rank resumes with the streams torchtitan seeded at start, so this resume is not "
                                 "exact"]
    # Control: excluding another part (torchtitan's dataloader, to change the process count) says nothing here.
    caplog.clear()
    with caplog.at_level("WARNING"):
        _load_as(checkpoint, 0, TWO, exclude=("dataloader",))
    assert not _warnings(caplog)


def test_a_changed_degree_is_named_by_the_layout_line_alone() -> None:
    from torchtitan_rng.integrations.torchtitan import config_drift

    saved = {"parallelism.tensor_parallel_degree": 2, "parallelism.data_parallel_shard_degree": -1}
    resumed = dict(saved, **{"parallelism.tensor_parallel_degree": 1})
    # The checkpoint records its layout: layout_change's line names the change, the drift check does not repeat it.
    assert config_drift(saved, resumed, layout_recorded=True) == []
    # Control: without a recorded layout the drift line is the only one that names it.
    [line] = config_drift(saved, resumed)
    assert line.startswith("parallelism.tensor_parallel_degree = 1 but the checkpoint was trained with 2")
