"""The torchtitan plug-in on the layouts big runs use, with the real torchtitan 0.3 wheel on the CPU (gloo, the
documented CPU example examples/torchtitan_cpu): 2-D layouts on 4 processes, context parallel, and an MoE model
with expert parallel. The slow tier: 4-process runs on a small machine.

For each layout one uninterrupted plug-in run to step 4 (``full``, saving at 2 and 4, validating at 1, 2 and 4)
is the reference; its checkpoint at step 2 is resumed to 4 by the plug-in (``resumed``: bitwise equal to
``full`` at every step) and by stock torchtitan (``stock``, the control: it ignores the streams and differs from
step 3). The model draws at random in its attention (dropout 0.1, the example's attention).

* FSDP 2 x TP 2, PP 2 x FSDP 2 (1F1B), HSDP (replicate 2 x shard 2), PP 2 x TP 2: 4 processes, llama;
* context parallel 2 (2 processes) and context parallel 2 x FSDP 2 (4): llama with ``--training.seq_len 256``
  (torchtitan shards the sequence in blocks of 128 per rank of the CP mesh's load balancing);
* expert parallel 2 on qwen3's MoE debug model, shrunk (2 processes: the experts over ranks that shard the rest,
  and 4 processes, FSDP 4);
* under FSDP 2 x TP 2, a SIGTERM to one rank: every rank saves a full checkpoint at the step they agree on and
  exits 0; the resume is bitwise;
* the FSDP 2 x TP 2 checkpoint resumed on FSDP 4: one WARNING line names both layouts and the rule;
* at every save, the ranks of each group that must draw the same masks (tensor parallel, context parallel,
  HSDP's replicate dimension) hold the same mask streams, as the plug-in's check says, and as the checkpoints
  show.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.support.checks import load_checkpoint
from tests.support.integrations.torchtitan_launch import (assets, compare_dumps, copy_checkpoint,  # noqa: F401
                                                          first_difference, plugin_flags, signalled_run, stop_step,
                                                          train_titan)
from tests.support.launch import together

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                 reason="torchtitan is not installed (pip install -e '.[torchtitan]')")]

STEPS, STOP = 4, 2
PP = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
      "--training.disable_cuda_graphs")
FSDP2 = ("--parallelism.data_parallel_shard_degree", "2")
TP2 = ("--parallelism.tensor_parallel_degree", "2")
CP2 = ("--parallelism.context_parallel_degree", "2", "--training.seq_len", "256")
EP2 = ("--parallelism.expert_parallel_degree", "2", "--training.disable_cuda_graphs")


class Layout:
    def __init__(self, processes: int, flags: tuple[str, ...], config: str = "tiny_llama",
                 groups: tuple[tuple[str, tuple[int, ...]], ...] = ()) -> None:
        self.processes, self.flags, self.config = processes, flags, config
        # The groups whose ranks must draw alike: (name in the plug-in's line, ranks).
        self.groups = groups


LAYOUTS = {
    "fsdp2_tp2": Layout(4, (*FSDP2, *TP2), groups=(("tensor-parallel", (0, 1)), ("tensor-parallel", (2, 3)))),
    "pp2_fsdp2": Layout(4, (*PP, *FSDP2)),
    "hsdp": Layout(4, ("--parallelism.data_parallel_replicate_degree", "2", *FSDP2),
                   groups=(("replicate (HSDP)", (0, 2)), ("replicate (HSDP)", (1, 3)))),
    "pp2_tp2": Layout(4, (*PP, *TP2), groups=(("tensor-parallel", (0, 1)), ("tensor-parallel", (2, 3)))),
    "cp2": Layout(2, CP2, groups=(("context-parallel", (0, 1)),)),
    "cp2_fsdp2": Layout(4, (*CP2, *FSDP2), groups=(("context-parallel", (0, 1)), ("context-parallel", (2, 3)))),
    "moe_ep2": Layout(2, EP2, config="tiny_qwen3_moe"),
    "moe_ep2_fsdp4": Layout(4, EP2, config="tiny_qwen3_moe"),
}
SIGNALLED = RESHAPED = "fsdp2_tp2"  # the layout also stopped by a signal, and resumed on another layout
FSDP4 = ("--parallelism.data_parallel_shard_degree", "4")


def _train(assets: Path, layout: Layout, dump: Path, *extra: str) -> str:
    proc = train_titan(assets, dump, STEPS, *extra, *layout.flags, nproc=layout.processes, config=layout.config)
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                assets: Path) -> tuple[str, dict[str, Path]]:
    """One layout's runs (``full``, ``resumed``, ``stock``; for FSDP 2 x TP 2 also ``signalled``, stopped by a
    SIGTERM to one rank and resumed, and ``reshaped``, ``full``'s checkpoint at 2 resumed on FSDP 4), each with its
    output beside it (``{name}.out``)."""
    name, layout = request.param, LAYOUTS[request.param]
    root = tmp_path_factory.mktemp(f"layout_{name}")
    names = ("full", "resumed", "stock", *(("signalled", "reshaped") if name == SIGNALLED else ()))
    dumps = {run: root / run for run in names}
    plugin = plugin_flags(assets)

    def signalled() -> None:
        dump = dumps["signalled"]
        (root / "signalled_stop.out").write_text(
            signalled_run(assets, dump, STEPS, *plugin, *layout.flags, nproc=layout.processes).stdout)
        _train(assets, layout, dump, *plugin)

    def full_and_resumed() -> None:
        _train(assets, layout, dumps["full"], *plugin)
        for run in ("resumed", "stock", "reshaped"):
            if run in dumps:
                copy_checkpoint(dumps["full"], dumps[run], STOP)
        resumes = [lambda: _train(assets, layout, dumps["resumed"], *plugin),
                   lambda: _train(assets, layout, dumps["stock"])]
        if "reshaped" in dumps:
            # torchtitan's dataloader refuses another data-parallel degree: its state is not loaded.
            resumes.append(lambda: train_titan(assets, dumps["reshaped"], STEPS, *plugin, *FSDP4,
                                               "--checkpoint.exclude_from_loading", "dataloader", nproc=4))
        together(*resumes)

    together(full_and_resumed, *([signalled] if "signalled" in dumps else []))
    return name, dumps


def _out(dump: Path) -> str:
    return (dump.parent / f"{dump.name}.out").read_text()


def test_stopped_and_resumed_is_bitwise(layout_runs: tuple[str, dict[str, Path]]) -> None:
    name, dumps = layout_runs
    assert f"Training starts at step {STOP + 1}" in _out(dumps["resumed"]), name
    result = compare_dumps(dumps["full"], dumps["resumed"])
    assert result.equal, f"{name}: {result.message}"
    assert "WARNING - torchtitan_rng" not in _out(dumps["full"]) + _out(dumps["resumed"]), name


def test_stock_resume_differs_from_the_first_resumed_step(layout_runs: tuple[str, dict[str, Path]]) -> None:
    name, dumps = layout_runs
    result = compare_dumps(dumps["full"], dumps["stock"])
    assert first_difference(result) == STOP + 1, f"{name}: {result.message}"


def test_the_layout_is_recorded(layout_runs: tuple[str, dict[str, Path]]) -> None:
    name, dumps = layout_runs
    layout = json.loads((dumps["full"] / "checkpoint" / f"step-{STOP}" / "run.json").read_text())["layout"]
    assert layout["world_size"] == LAYOUTS[name].processes
    flags = LAYOUTS[name].flags
    for degree, flag in (("tp", "tensor_parallel"), ("pp", "pipeline_parallel"), ("cp", "context_parallel"),
                         ("ep", "expert_parallel"), ("dp_replicate", "data_parallel_replicate")):
        expected = int(flags[flags.index(f"--parallelism.{flag}_degree") + 1]) if (
            f"--parallelism.{flag}_degree" in flags) else 1
        assert layout[degree] == expected, (name, layout)


def test_groups_that_draw_alike_hold_equal_mask_streams_at_every_save(layout_runs: tuple[str, dict[str, Path]],
                                                                      tmp_path: Path) -> None:
    from torchtitan_rng.checkpoint.train_state import decode_state
    from torchtitan_rng.integrations.torchtitan import MASK_STREAMS
    from torchtitan_rng.rng import fingerprint

    name, dumps = layout_runs
    out = _out(dumps["full"])
    assert "group hold different" not in out, name
    said = [line.split("torchtitan_rng: ")[1] for line in out.splitlines() if "the mask streams of" in line]
    expected = [f"step {step}: the mask streams of {group} ranks {', '.join(map(str, ranks))} are equal"
                for step in (STOP, STEPS) for group, ranks in LAYOUTS[name].groups]
    assert sorted(said) == sorted(expected), (name, said)
    if not LAYOUTS[name].groups:
        return
    # What the check saw, read back from the checkpoints: each group's ranks hold the same mask streams at each
    # save. Control: the same comparison tells a rank's streams of step 2 from those of step 4 (masks drew).
    seen = {}
    for step in (STOP, STEPS):
        saved = load_checkpoint(dumps["full"] / "checkpoint" / f"step-{step}", tmp_path / f"{step}.pt")
        ranks = [decode_state(saved["torchtitan_rng"][f"rank_{rank}"])["rng"]
                 for rank in range(LAYOUTS[name].processes)]
        seen[step] = [{stream: fingerprint(streams[stream]) for stream in MASK_STREAMS} for streams in ranks]
        for _, group in LAYOUTS[name].groups:
            assert len({json.dumps(seen[step][rank], sort_keys=True) for rank in group}) == 1, (name, step, group)
    assert seen[STOP][0]["torch_cpu"] != seen[STEPS][0]["torch_cpu"], name


@pytest.mark.parametrize("layout_runs", [SIGNALLED], indirect=True)
def test_sigterm_to_one_rank_under_fsdp_tp_saves_at_one_step_and_resumes_bitwise(
        layout_runs: tuple[str, dict[str, Path]]) -> None:
    from torchtitan_rng.checkpoint.safe_load import SafeFileSystemReader

    name, dumps = layout_runs
    signalled = dumps["signalled"]
    step = stop_step((signalled.parent / "signalled_stop.out").read_text(), LAYOUTS[name].processes, STEPS)
    keys = set(SafeFileSystemReader(signalled / "checkpoint" / f"step-{step}").read_metadata().state_dict_metadata)
    assert {f"torchtitan_rng.rank_{rank}" for rank in range(4)} <= keys
    assert any(key.startswith("optimizer.") for key in keys), "the signal's checkpoint holds no optimizer state"
    assert f"Training starts at step {step + 1}" in _out(signalled)
    result = compare_dumps(dumps["full"], signalled)
    assert result.equal, result.message


@pytest.mark.parametrize("layout_runs", [RESHAPED], indirect=True)
def test_another_layout_at_a_resume_is_named_once_with_the_rule(layout_runs: tuple[str, dict[str, Path]]) -> None:
    name, dumps = layout_runs
    warnings = [line for line in _out(dumps["reshaped"]).splitlines() if "WARNING - torchtitan_rng" in line]
    expected = ("torchtitan_rng: the checkpoint was saved by 4 processes (dp_shard 2 x tp 2) and this run has 4 "
                "processes (dp_shard 4): ranks 0-3 restore the streams saved by the rank of the same number; this "
                "resume is not exact")
    assert len(warnings) == 1 and warnings[0].endswith(expected), warnings
    assert (dumps["reshaped"] / "checkpoint" / f"step-{STEPS}").is_dir()
    # Control: the same checkpoint resumed on its own layout says nothing of the kind (and is exact, above).
    assert "saved by" not in _out(dumps["resumed"])
