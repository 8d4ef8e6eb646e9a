"""The table of random-stream purposes in rng.py: documented, the only way the package derives a seed, and
numerically the same seeds as before the table existed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tests.support.launch import REPO
from torchtitan_rng import device as device_lib
from torchtitan_rng import rng
from torchtitan_rng.rng import FROZEN_SEED, STREAMS, derive_seed, frozen_generator, stream_seed

PACKAGE = REPO / "torchtitan_rng"
# The free-form derivations users call with their own purposes: only rng.py and the per-sample helpers use them.
FREE_FORM = {"derive_seed", "derived_generator", "derived_numpy_generator"}
FREE_FORM_ALLOWED = {PACKAGE / "rng.py", PACKAGE / "data" / "sample_rng.py"}
BY_NAME = {"stream_seed": "run", "stream_generator": "run", "sample_purpose": "run", "frozen_generator": "frozen"}


def markdown_table() -> str:
    rows = ["| purpose | root | scope | keys | feeds |", "| --- | --- | --- | --- | --- |"]
    for s in STREAMS.values():
        rows.append(f"| `{s.purpose}` | {s.root} | {s.scope} | {', '.join(s.keys) or '-'} | {s.feeds} |")
    return "\n".join(rows)


def test_randomness_page_shows_the_table() -> None:
    page = (REPO / "docs" / "randomness.md").read_text()
    assert markdown_table() in page, f"docs/randomness.md must hold this table, as rng.STREAMS:\n{markdown_table()}"


def _calls(path: Path) -> list[tuple[str, ast.Call]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            found.append((name, node))
    return found


def test_every_derived_seed_of_the_package_is_drawn_by_a_purpose_of_the_table() -> None:
    used: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(REPO)
        for name, call in _calls(path):
            if name in FREE_FORM:
                assert path in FREE_FORM_ALLOWED, f"{where}:{call.lineno} calls {name}: draw by a purpose of rng.STREAMS"
            if name in BY_NAME and path != PACKAGE / "rng.py":
                first = call.args[0] if call.args else None
                assert isinstance(first, ast.Constant), f"{where}:{call.lineno}: {name} needs a literal purpose"
                assert first.value in STREAMS, f"{where}:{call.lineno}: {first.value!r} is not in rng.STREAMS"
                assert STREAMS[first.value].root == BY_NAME[name], f"{where}:{call.lineno}: wrong root for {name}"
                used.add(first.value)
    # seed_training_streams, seed_micro_batch_streams, seed_layer_streams and seed_model_init draw inside rng.py.
    assert used | {"training-streams", "micro-batch", "micro-batch-layer", "model-init"} == set(STREAMS), \
        "a purpose of the table is drawn nowhere"


def test_seeds_are_those_of_the_plain_derivation() -> None:
    """Behaviour unchanged: a purpose's seed is derive_seed(root, purpose, *keys), as before the table."""
    for s in STREAMS.values():
        keys = tuple(range(3, 3 + len(s.keys)))
        if s.root == "run":
            assert stream_seed(s.purpose, 7, *keys) == derive_seed(7, s.purpose, *keys)
        else:
            expected = derive_seed(FROZEN_SEED, s.purpose, *keys)
            assert frozen_generator(s.purpose, *keys).initial_seed() == expected
    # Control: the comparison sees a change of seed, key or purpose.
    assert stream_seed("sampler", 7, 0) != stream_seed("sampler", 8, 0) != stream_seed("sampler", 8, 1)
    assert stream_seed("sampler", 7, 0) != stream_seed("dataloader", 7, 0)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: stream_seed("augment", 0, 1), "'augment' is not a random-stream purpose of this project"),
    (lambda: stream_seed("flux-t5", 0), "'flux-t5' has the frozen root: draw it with frozen_generator"),
    (lambda: frozen_generator("sampler", 0), "'sampler' has the run root: draw it with stream_seed"),
    (lambda: stream_seed("sampler", 0), "'sampler' takes epoch; got 0 key(s)"),
    (lambda: rng.sample_purpose("sampler"), "'sampler' is not drawn per sample"),
])
def test_a_purpose_outside_the_table_is_one_clear_error(call, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        call()
    assert message in str(raised.value) and "\n" not in str(raised.value)


def _torch_states() -> list[bytes]:
    """The CPU generator's state and, on an accelerator, the current device's, as bytes."""
    states = [torch.get_rng_state()]
    if device_lib.device_module is not None:
        states.append(device_lib.device_module.get_rng_state())
    return [state.numpy().tobytes() for state in states]


@pytest.mark.parametrize("value", [0, 7, stream_seed("micro-batch-layer", 3, 2, 1, 0), (1 << 63) - 1])
def test_seeding_leaves_the_generators_as_torch_manual_seed_leaves_them(value: int) -> None:
    """The fast seeding (every block of every micro-batch in the world-size-invariant mode) puts the CPU and the
    device generator in the state torch.manual_seed puts them in, so the streams drawn after it are unchanged."""
    with rng.preserved_global_rng(torch.device(device_lib.device_type)):
        torch.manual_seed(value)
        expected = _torch_states()
        torch.manual_seed(value + 1)  # control: another seed leaves another state
        other = _torch_states()
        device_lib.seed_generators(value)
        got = _torch_states()
    assert got == expected
    assert all(a != b for a, b in zip(other, expected))
