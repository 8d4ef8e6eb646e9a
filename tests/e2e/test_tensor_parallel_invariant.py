"""Layout-free training with tensor parallelism (``--parallelism.world_size_invariant``, llama's heads and hidden
features in 4 tensor chunks): the same loss log, bit for bit, at 1 process, tp 2, dp 2 x tp 2, and (slow tier)
dp 2, dp 4 and pp 2 x tp 2, all against one reference; a run stopped on dp 2 x tp 2 and resumed on tp 2, and on
one process; and the control, the ordinary mode at tp 2 against tp 1, which differs. (Its pieces: tests/unit/test_tensor_chunks.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.launch import compare, together, train
from torchtitan_rng.loss_log import read_loss_log

# The slow tier (CI): the everyday suite stays within its time on 2 cores.
pytestmark = pytest.mark.slow

STEPS = 4
STOP = 2
# 4 micro-batches of 2 per step: 4, 2 or 1 per data shard at 1, 2 and 4 of them.
SHAPE = ("--training.local_batch_size", "2", "--training.global_batch_size", "8", "--training.seq_len", "32",
         "--training.steps", str(STEPS), "--lr_scheduler.total_steps", str(STEPS))
INVARIANT = ("--parallelism.world_size_invariant", *SHAPE)
TP = "--parallelism.tensor_parallel_degree"
PP = ("--parallelism.pipeline_parallel_degree", "2")
CHECKPOINTED = ("--checkpoint.enable", "--checkpoint.interval", str(STOP))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The reference on 1 process, tp 2, and dp 2 x tp 2 saving a checkpoint at step STOP, side by side; then
    that checkpoint resumed on tp 2 and on one process, and the ordinary mode's control at tp 1 and tp 2, side by
    side."""
    root = tmp_path_factory.mktemp("tp_invariant")
    dumps = {name: root / name for name in ("one", "tp2", "dp2_tp2", "resumed_tp2", "resumed_one",
                                            "ordinary_tp1", "ordinary_tp2")}
    together(lambda: train(dumps["one"], *INVARIANT),
             lambda: train(dumps["tp2"], *INVARIANT, TP, "2", nproc=2),
             lambda: train(dumps["dp2_tp2"], *INVARIANT, *CHECKPOINTED, TP, "2", nproc=4))
    name = f"step-{STOP}"
    for resumed in ("resumed_tp2", "resumed_one"):
        shutil.copytree(dumps["dp2_tp2"] / "checkpoint" / name, dumps[resumed] / "checkpoint" / name)
    together(lambda: train(dumps["resumed_tp2"], *INVARIANT, *CHECKPOINTED, TP, "2", nproc=2),
             lambda: train(dumps["resumed_one"], *INVARIANT, *CHECKPOINTED),
             lambda: train(dumps["ordinary_tp1"], *SHAPE),
             lambda: train(dumps["ordinary_tp2"], *SHAPE, TP, "2", nproc=2))
    return dumps


def _assert_same_bits(reference: Path, other: Path, *extra: str) -> None:
    result = compare(reference, other, *extra)
    assert result.returncode == 0, result.stdout


def test_same_bits_at_1_process_tp_2_and_dp_2_x_tp_2(runs: dict[str, Path]) -> None:
    for layout in ("tp2", "dp2_tp2"):
        _assert_same_bits(runs["one"], runs[layout])
    assert sorted(read_loss_log(runs["dp2_tp2"])) == list(range(1, STEPS + 1))


def test_stopped_on_dp_2_x_tp_2_resumed_on_tp_2_and_on_1_process_same_bits(runs: dict[str, Path]) -> None:
    """The 4-process checkpoint (its tensor-split weights sharded over dp and tp) continued by 2 processes
    splitting the layers, and by one process holding them whole."""
    for resumed in ("resumed_tp2", "resumed_one"):
        assert sorted(read_loss_log(runs[resumed])) == list(range(STOP + 1, STEPS + 1))
        _assert_same_bits(runs["one"], runs[resumed], "--only-common-steps")


def test_control_ordinary_tensor_parallelism_differs_from_one_process(runs: dict[str, Path]) -> None:
    """The comparison can fail: in the ordinary mode a layer split over 2 ranks sums its halves otherwise (and
    draws its masks otherwise) than the whole layer on one."""
    result = compare(runs["ordinary_tp1"], runs["ordinary_tp2"])
    assert result.returncode == 1
    assert result.stdout.startswith("first differing step 1:"), result.stdout


@pytest.mark.slow
def test_same_bits_at_dp_2_dp_4_and_pp_2_x_tp_2(runs: dict[str, Path], tmp_path: Path) -> None:
    """The other layouts of the reference's step: data parallel over 2 and 4 processes (the chunks computed
    whole on each), and two pipeline stages each split over 2 tensor-parallel ranks."""
    dumps = {name: tmp_path / name for name in ("dp2", "dp4", "pp2_tp2")}
    together(lambda: train(dumps["dp2"], *INVARIANT, nproc=2),
             lambda: train(dumps["dp4"], *INVARIANT, nproc=4),
             lambda: train(dumps["pp2_tp2"], *INVARIANT, *PP, TP, "2", nproc=4))
    for dump in dumps.values():
        _assert_same_bits(runs["one"], dump)


@pytest.mark.slow
def test_bf16_compile_and_ac_same_bits_at_1_process_and_tp_2(tmp_path: Path) -> None:
    """The chunked layers with the features of real runs (bf16 autocast, torch.compile, selective activation
    checkpointing) split over 2 ranks. Control: the same run in float32 differs, so bf16 was applied."""
    features = ("--training.mixed_precision_param", "bfloat16", "--compile.enable",
                "--activation_checkpoint.mode", "selective", "--training.steps", "2")
    dumps = {name: tmp_path / name for name in ("one", "tp2", "float32")}
    train(dumps["one"], *INVARIANT, *features)  # first: it fills inductor's cache for the others
    together(lambda: train(dumps["tp2"], *INVARIANT, *features, TP, "2", nproc=2),
             lambda: train(dumps["float32"], *INVARIANT, *features[2:]))
    _assert_same_bits(dumps["one"], dumps["tp2"])
    control = compare(dumps["one"], dumps["float32"])
    assert control.returncode == 1 and control.stdout.startswith("first differing step 1:"), control.stdout
