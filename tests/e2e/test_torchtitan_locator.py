"""The tensor locator in the torchtitan plug-in (``--override.imports 'torchtitan_rng.integrations.torchtitan.
exact_resume={"tensor_fingerprint": true, "fingerprint_modules_at_step": 1}'``): real torchtitan 0.3 runs of the
CPU example's tiny llama on 2 processes (gloo), one divergence each, and ``compare_losses`` on the two dump folders
naming the first thing that differs, with step, rank and tensor:

* FSDP 2: the reference's checkpoint at step 2 resumed with the same flags (the control: identical, exit 0); the
  same checkpoint resumed with ``--training.max_norm 0.01`` (the update, with the changed key); the text file with
  its lines in another order (the data); ``layers.0.attention.wo`` made noisy (a computation, named at the module);
* pipeline parallel 2 (1F1B: each rank holds other parameters): the checkpoint at step 2 resumed (the control);
  ``layers.1.attention.wo``, held by the second stage, made noisy: named on rank 1, the first stage's calls equal;
  the same under Interleaved1F1B (two stages per rank: rank 0 holds the embeddings and ``layers.1``): named on
  rank 0, in its second stage;
* tensor parallel 2 (each parameter sharded over both ranks): the checkpoint at step 2 resumed with
  ``--training.max_norm 0.01``: what the resume loaded equal shard by shard, the update named.

The resumed runs start in a folder holding the reference's checkpoint and its loss-log and fingerprint lines up to
the checkpoint, as a run stopped there holds them (tests/e2e/test_torchtitan_plugin.py shares runs the same way)."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

from tests.support.integrations.torchtitan_launch import PLUGIN, assets, copy_checkpoint, train_titan  # noqa: F401
from tests.support.launch import together
from torchtitan_rng.compare_losses import main as compare_losses

# The slow tier (CI runs it): every run is a torchrun launch of torchtitan.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                 reason="torchtitan is not installed (pip install -e '.[torchtitan]')")]

STEPS, STOP = 4, 2
FLAGS = ("--override.imports",
         PLUGIN + "=" + json.dumps({"tensor_fingerprint": True, "fingerprint_modules_at_step": 1}))
NOISY = "tests.support.integrations.titan_noisy.noisy_layer{}"
PIPELINE = ("--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs")
PP = (*PIPELINE, "--parallelism.pipeline_parallel_schedule", "1F1B")
INTERLEAVED = (*PIPELINE, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B")
TP = ("--parallelism.tensor_parallel_degree", "2")
Capture = pytest.CaptureFixture[str]


def _stopped_at(source: Path, dump: Path, step: int) -> None:
    """``dump`` as ``source`` stopped at ``step``: its checkpoint there, its loss log and fingerprints up to it."""
    copy_checkpoint(source, dump, step)
    for prints in (source / "tensor_fingerprints").glob("rank*.jsonl"):
        lines = [line for line in prints.read_text().splitlines() if json.loads(line)["step"] <= step]
        (dump / "tensor_fingerprints").mkdir(parents=True, exist_ok=True)
        (dump / "tensor_fingerprints" / prints.name).write_text("".join(line + "\n" for line in lines))


def _shuffled_text(assets: Path, folder: Path) -> Path:
    """The example's text with its lines in another order."""
    folder.mkdir()
    for source in (assets / "text").iterdir():
        lines = source.read_text().splitlines()
        random.Random(0).shuffle(lines)
        (folder / source.name).write_text("".join(line + "\n" for line in lines))
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> dict[str, Path]:  # noqa: F811
    root = tmp_path_factory.mktemp("titan_locator")
    dumps = {name: root / name for name in ("reference", "resumed", "max_norm", "shuffled", "noisy", "pp",
                                            "pp_resumed", "pp_noisy", "interleaved", "interleaved_noisy", "tp",
                                            "tp_max_norm")}
    shuffled = _shuffled_text(assets, root / "shuffled_text")

    def reference_and_resume(reference: str, resumes: dict[str, tuple[str, ...]], *layout: str) -> None:
        train_titan(assets, dumps[reference], STEPS, *FLAGS, *layout)
        for name in resumes:
            _stopped_at(dumps[reference], dumps[name], STOP)
        together(*(lambda name=name, extra=extra: train_titan(assets, dumps[name], STEPS, *FLAGS, *layout, *extra)
                   for name, extra in resumes.items()))

    max_norm = ("--training.max_norm", "0.01")
    together(lambda: reference_and_resume("reference", {"resumed": (), "max_norm": max_norm}),
             lambda: train_titan(assets, dumps["shuffled"], STOP, *FLAGS, "--dataloader.dataset_path", str(shuffled)),
             lambda: train_titan(assets, dumps["noisy"], STOP, *FLAGS, NOISY.format(0)),
             lambda: reference_and_resume("pp", {"pp_resumed": ()}, *PP),
             lambda: train_titan(assets, dumps["pp_noisy"], STOP, *FLAGS, NOISY.format(1), *PP),
             lambda: train_titan(assets, dumps["interleaved"], STOP, *FLAGS, *INTERLEAVED),
             lambda: train_titan(assets, dumps["interleaved_noisy"], STOP, *FLAGS, NOISY.format(1), *INTERLEAVED),
             lambda: reference_and_resume("tp", {"tp_max_norm": max_norm}, *TP))
    return dumps


def _located(runs: dict[str, Path], a: str, b: str, capsys: Capture) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = compare_losses([str(runs[a]), str(runs[b])])
    lead = "the first tensor that differs: "
    return code, [line[len(lead):] for line in capsys.readouterr().out.splitlines() if line.startswith(lead)]


@pytest.mark.parametrize("reference, resumed", [("reference", "resumed"), ("pp", "pp_resumed")])
def test_control_an_exact_resume_names_nothing(runs: dict[str, Path], capsys: Capture, reference: str,
                                               resumed: str) -> None:
    capsys.readouterr()
    assert compare_losses([str(runs[reference]), str(runs[resumed])]) == 0
    assert capsys.readouterr().out.splitlines() == [f"identical: {STEPS} steps (1..{STEPS}) with bitwise-equal losses"]
    # Each rank recorded each step, the resume's process from where it loaded (its first line: what it loaded).
    for rank in (0, 1):
        lines = [json.loads(line) for line in
                 (runs[resumed] / "tensor_fingerprints" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
        assert "entering" in lines[STOP] and lines[STOP]["entering"]["optim"], lines[STOP].keys()


def test_another_data_order_is_the_data(runs: dict[str, Path], capsys: Capture) -> None:
    code, lines = _located(runs, "reference", "shuffled", capsys)
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("step 1, rank 0: the batch of micro-batch 0 differs (`input`, sample(s) "), lines
    assert lines[0].endswith("): the data, not the model"), lines


def test_a_noisy_module_is_named_at_its_output(runs: dict[str, Path], capsys: Capture) -> None:
    code, lines = _located(runs, "reference", "noisy", capsys)
    assert code == 1 and lines == ["step 1, rank 0: `layers.0.attention.wo` output differs, its input equal (a "
                                   "kernel: an operation inside it gave other bits; its parameters entered the step "
                                   "equal)"], lines


@pytest.mark.parametrize("reference, changed", [("reference", "max_norm"), ("tp", "tp_max_norm")])
def test_max_norm_changed_at_the_resume_is_the_update(runs: dict[str, Path], capsys: Capture, reference: str,
                                                      changed: str) -> None:
    code, lines = _located(runs, reference, changed, capsys)
    assert code == 1 and lines == [
        f"step {STOP + 1}, rank 0: gradients equal on every rank, parameter `tok_embeddings.weight` after the update "
        "differs (the optimizer: its state or its hyperparameters; the configs differ in training.max_norm 1.0 → "
        f"0.01 (B's resume entering step {STOP + 1}); the optimizer state equal where last compared, entering this "
        "step)"], lines


def test_pipeline_stages_are_compared_rank_by_rank(runs: dict[str, Path], capsys: Capture) -> None:
    # Each stage records only the parameters it holds (the second: layers.1, norm, lm_head).
    first, second = ({*json.loads((runs["pp"] / "tensor_fingerprints" / f"rank{rank}.jsonl").read_text()
                                  .splitlines()[0])["param"]} for rank in (0, 1))
    assert "layers.1.attention.wo.weight" in second - first and "tok_embeddings.weight" in first - second
    code, lines = _located(runs, "pp", "pp_noisy", capsys)
    assert code == 1 and lines == ["step 1, rank 1: `layers.1.attention.wo` output differs, its input equal (a "
                                   "kernel: an operation inside it gave other bits; its parameters entered the step "
                                   "equal)"], lines


def test_two_pipeline_stages_on_a_rank_are_recorded_as_one_model(runs: dict[str, Path], capsys: Capture) -> None:
    first = json.loads((runs["interleaved"] / "tensor_fingerprints" / "rank0.jsonl").read_text().splitlines()[0])
    assert {"tok_embeddings.weight", "layers.1.attention.wo.weight"} <= set(first["param"]), first["param"].keys()
    code, lines = _located(runs, "interleaved", "interleaved_noisy", capsys)
    assert code == 1 and lines == ["step 1, rank 0: `layers.1.attention.wo` output differs, its input equal (a "
                                   "kernel: an operation inside it gave other bits; its parameters entered the step "
                                   "equal)"], lines


def test_tensor_parallel_shards_are_hashed_as_parts_of_the_whole(runs: dict[str, Path]) -> None:
    # Each rank hashed its shard of each sharded parameter (named as sharded): the locator can add them up.
    for rank in (0, 1):
        first = json.loads((runs["tp"] / "tensor_fingerprints" / f"rank{rank}.jsonl").read_text().splitlines()[0])
        assert "layers.0.attention.wo.weight" in first["sharded"], first.get("sharded")
