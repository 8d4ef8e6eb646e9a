"""The streaming source: its file position AND shuffle-buffer contents are saved, so a resume is exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from torchtitan_rng.checkpoint.codec import decode_state, encode_state
from torchtitan_rng.config import ConfigError, parse_args
from torchtitan_rng.checkpoint.layout import CheckpointError
from torchtitan_rng.distributed import World
from torchtitan_rng.parallel import ParallelPlan
from torchtitan_rng.data.dataloader import ResumableDataLoader, dp_rank_key, shutdown_workers
from torchtitan_rng.data.streaming import StreamingDataLoader
from torchtitan_rng.models.llama.dataset import build_text_dataset

SEQ_LEN, BATCH, BUFFER, WINDOWS_PER_EPOCH = 15, 4, 8, 40


def make_loader(path: Path, num_workers: int, dp_rank: int = 0, dp_world: int = 1) -> StreamingDataLoader:
    config = parse_args(["--training.dataset_path", str(path), "--data.streaming", "--training.seq_len", str(SEQ_LEN),
                         "--data.shuffle_buffer", str(BUFFER), "--data.num_samples", str(WINDOWS_PER_EPOCH)])
    return StreamingDataLoader(build_text_dataset(config), batch_size=BATCH, dp_rank=dp_rank, dp_world=dp_world,
                               seed=0, num_workers=num_workers)


def stream(path: Path, num_workers: int, batches: int, stop_at: int | None = None,
           edit: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> tuple[list[int], torch.Tensor]:
    """Window ids and tokens of ``batches`` batches; with ``stop_at``, the loader is saved there and a new one
    (new workers) resumes from the saved state (after ``edit``)."""
    loader = make_loader(path, num_workers)
    batch_iter = iter(loader)
    ids: list[int] = []
    tokens: list[torch.Tensor] = []
    for index in range(batches):
        if index == stop_at:
            state = loader.state_dict()
            del batch_iter
            loader = make_loader(path, num_workers)
            loader.load_state_dict(edit(state) if edit else state)
            batch_iter = iter(loader)
        batch = next(batch_iter)
        ids += batch["window"].tolist()
        tokens.append(batch["input"])
    return ids, torch.cat(tokens)


def without_buffer_contents(state: dict[str, Any]) -> dict[str, Any]:
    """The control: the same saved state with every shuffle buffer emptied (position and generator kept)."""
    def strip(item: Any) -> Any:
        if isinstance(item, dict) and "buffer_ids" in item:
            return {**item, "buffer_ids": item["buffer_ids"][:0], "buffer": item["buffer"][:0]}
        if isinstance(item, dict):
            return {key: strip(value) for key, value in item.items()}
        return item
    key = dp_rank_key(0)
    return {key: encode_state(strip(decode_state(state[key])))}


@pytest.mark.parametrize("kind", ["bin", "jsonl"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resumed_stream_yields_the_same_windows(token_files: dict[str, Path], kind: str, num_workers: int) -> None:
    # 30 batches of 4 cross two epoch ends (40 windows each); the stop is mid-epoch with a full buffer.
    uninterrupted_ids, uninterrupted_tokens = stream(token_files[kind], num_workers, 30)
    resumed_ids, resumed_tokens = stream(token_files[kind], num_workers, 30, stop_at=11)
    assert resumed_ids == uninterrupted_ids
    assert torch.equal(resumed_tokens, uninterrupted_tokens)  # int64 tokens: equal is bitwise
    control_ids, _ = stream(token_files[kind], num_workers, 30, stop_at=11, edit=without_buffer_contents)
    assert control_ids[: 11 * BATCH] == uninterrupted_ids[: 11 * BATCH]
    assert control_ids[11 * BATCH :] != uninterrupted_ids[11 * BATCH :]


def test_each_epoch_is_a_new_shuffle_of_every_window(token_files: dict[str, Path]) -> None:
    ids, _ = stream(token_files["bin"], 0, 3 * WINDOWS_PER_EPOCH // BATCH)
    epochs = [ids[start : start + WINDOWS_PER_EPOCH] for start in range(0, len(ids), WINDOWS_PER_EPOCH)]
    assert all(sorted(epoch) == list(range(WINDOWS_PER_EPOCH)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 3
    assert epochs[0] != sorted(epochs[0])


def _first_windows(path: Path, num_workers: int, dp_rank: int, batches: int) -> list[int]:
    batch_iter = iter(make_loader(path, num_workers, dp_rank=dp_rank, dp_world=2))
    return [i for _ in range(batches) for i in next(batch_iter)["window"].tolist()]


def test_ranks_and_workers_read_disjoint_shares(token_files: dict[str, Path]) -> None:
    # 2 ranks, no workers: window i is rank i % 2's; one epoch of each covers the epoch once.
    rank0, rank1 = (_first_windows(token_files["jsonl"], 0, rank, WINDOWS_PER_EPOCH // 2 // BATCH) for rank in (0, 1))
    assert {i % 2 for i in rank0} == {0} and {i % 2 for i in rank1} == {1}
    assert sorted(rank0 + rank1) == list(range(WINDOWS_PER_EPOCH))
    # 2 ranks x 2 workers: window i is stream i % 4's, rank 0 reading streams 0 and 1 (2 batches a worker).
    rank0, rank1 = (_first_windows(token_files["jsonl"], 2, rank, 4) for rank in (0, 1))
    assert {i % 4 for i in rank0} == {0, 1} and {i % 4 for i in rank1} == {2, 3}
    assert len(set(rank0 + rank1)) == len(rank0 + rank1)


def test_another_worker_count_is_refused_in_one_line(token_files: dict[str, Path]) -> None:
    loader = make_loader(token_files["bin"], 0)
    next(iter(loader))
    with pytest.raises(ConfigError) as err:
        make_loader(token_files["bin"], 2).load_state_dict(loader.state_dict())
    assert str(err.value) == (
        "the checkpoint's stream was split over 1 process(es) x 0 dataloader worker(s) and this run has 1 x 2: "
        "each share's file position and shuffle buffer belong to that split; resume with --data.num_workers 0 on "
        "1 process(es)"
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bad_line_met_while_streaming_is_one_line(tmp_path: Path, num_workers: int) -> None:
    path = tmp_path / "late.jsonl"
    path.write_text("".join(f'{{"text": "document {i} {"x" * 40}"}}\n' for i in range(5)) + '{"txt": "oops"}\n')
    loader = make_loader(path, num_workers)
    batch_iter = iter(loader)
    with pytest.raises(ConfigError) as err:
        for _ in range(100):
            next(batch_iter)
    shutdown_workers(loader)  # now: left to the garbage collector, the workers take seconds to give up
    assert str(err.value) == f'config training.dataset_path: {path} line 6: no "text" field holding a string'


def test_stream_and_map_style_checkpoints_do_not_mix(token_files: dict[str, Path]) -> None:
    config = parse_args(["--training.dataset_path", str(token_files["bin"]), "--training.seq_len", str(SEQ_LEN)])
    map_loader = ResumableDataLoader(build_text_dataset(config), batch_size=BATCH, dp_rank=0, dp_world=1, seed=0)
    with pytest.raises(ConfigError, match="came from the map-style dataset and this run streams"):
        make_loader(token_files["bin"], 0).load_state_dict(map_loader.state_dict())
    with pytest.raises(ConfigError, match="came from a streaming source .* and this run uses the map-style"):
        map_loader.load_state_dict(make_loader(token_files["bin"], 0).state_dict())
    # Resuming on another process count with checkpoint.on_world_size_change = reseed: a stream cannot be re-split.
    with pytest.raises(CheckpointError, match="cannot be re-split over another process count: resume with 2"):
        plan = ParallelPlan(parse_args([]), World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
        plan.position_data(make_loader(token_files["bin"], 0).batch_sampler, 4, 2, reseeded=True)
