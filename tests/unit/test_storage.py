"""The checkpoint storage (checkpoint/storage.py) without training: a checkpoint folder may be a URL,
what counts as a checkpoint of the run (completion marker, entries it did not write), checksums streamed
from a store, the keyed signature of checksums.json. Stores: fsspec's in-memory one, and a real
S3-compatible server on this machine (moto) for s3://."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.object_store import s3, s3_server
from torchtitan_rng.checkpoint import integrity, layout
from torchtitan_rng.checkpoint.manager import CheckpointManager
from torchtitan_rng.checkpoint.states import ModelState
from torchtitan_rng.checkpoint.storage import checkpoint_folder, locate
from torchtitan_rng.errors import CheckpointError


def _memory_folder() -> str:
    return f"memory://test-{uuid.uuid4().hex}/checkpoint"


def test_a_url_stands_alone_and_a_path_stays_under_the_dump_folder(tmp_path: Path) -> None:
    assert str(checkpoint_folder(tmp_path, "checkpoint")) == str(tmp_path / "checkpoint")
    url = checkpoint_folder(tmp_path, "memory://bucket/run")
    assert url.local is None and str(url).startswith("memory://") and str(url).endswith("/bucket/run")
    local = checkpoint_folder(tmp_path, f"file://{tmp_path}/elsewhere")
    assert local.local == tmp_path / "elsewhere" and local.storage.atomic_rename


def test_a_url_without_its_backend_names_the_extra_to_install() -> None:
    assert importlib.util.find_spec("gcsfs") is None  # the case under test: the backend is not installed
    with pytest.raises(CheckpointError, match=r"gs://bucket/run is on gs://, whose fsspec backend is not "
                                              r"installed .*: pip install 'torchtitan_rng\[gcs\]'"):
        locate("gs://bucket/run")


def test_nothing_of_a_store_is_imported_by_a_run_that_does_not_use_one() -> None:
    code = ("import sys, torchtitan_rng.trainer, torchtitan_rng.launch.launcher, torchtitan_rng.own_loop; "
            "print(sorted(m for m in ('fsspec', 's3fs', 'gcsfs', 'boto3') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


@pytest.mark.parametrize("size", [0, 5, 8, 32 * 1024 - 3, 32 * 1024, 3 * 32 * 1024 + 13, 64 * 2**20 + 11])
def test_the_checksum_streamed_from_a_store_is_the_local_one(tmp_path: Path, size: int) -> None:
    """The store's file arrives in 64 MiB buffers, the local one memory-mapped whole: one sum (the last size
    crosses a buffer boundary). Control: one flipped bit changes it."""
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    (tmp_path / "f").write_bytes(data)
    remote = locate(_memory_folder()) / "f"
    remote.write_bytes(data)
    assert integrity.file_sum(remote) == integrity.file_sum(tmp_path / "f")
    if size:
        flipped = bytearray(data)
        flipped[size // 2] ^= 0x04
        remote.write_bytes(bytes(flipped))
        assert integrity.file_sum(remote) != integrity.file_sum(tmp_path / "f")


def _save(folder: str | Path, steps: range, **options: object) -> torch.nn.Module:
    model = torch.nn.Linear(16, 16)
    manager = CheckpointManager(folder, {"model": ModelState(model)}, interval=1, **options)
    manager.run_record = {"config": {}}
    for step in steps:
        manager.save(step, last_step=steps[-1])
    manager.close()
    return model


def test_on_a_store_a_checkpoint_counts_once_marked_and_pruning_keeps_what_the_run_did_not_write() -> None:
    folder = _memory_folder()
    store = locate(folder)
    (store / "step-9" / layout.METADATA_NAME).write_bytes(b"a save cut short: no marker")
    (store / "step-7").write_bytes(b"a user's object named like a checkpoint")
    model = _save(folder, range(1, 5), keep_latest_k=2, async_mode="async")
    found = layout.scan(folder)
    assert found.complete == [3, 4] and found.unfinished == [9] and found.damaged == []
    assert found.ignored == [f"{store / 'step-7'} is a file, not a checkpoint this run wrote: ignored (never "
                             "followed, renamed or deleted)"]
    assert (store / "step-7").read_bytes() == b"a user's object named like a checkpoint"
    # A copy of step-3 under another step's name: its marker says 3; not loaded, named.
    for name in (store / "step-3").files():
        (store / "step-12" / name).write_bytes((store / "step-3" / name).read_bytes())
    assert layout.complete_steps(folder) == [3, 4]
    assert "step-12 holds a checkpoint saved as another step (its complete.json names 3)" in layout.ignored_entries(folder)[0]
    picked = layout.resolve_checkpoint(folder)
    assert picked == store / "step-4"
    assert integrity.verify_integrity(picked)
    fresh = torch.nn.Linear(16, 16)
    CheckpointManager(folder, {"model": ModelState(fresh)}, interval=1).load(picked)
    assert torch.equal(fresh.weight, model.weight)


def test_a_save_of_a_step_cut_short_is_redone_and_a_stranger_in_its_way_refused() -> None:
    folder = _memory_folder()
    store = locate(folder)
    (store / "step-1" / "__0_0.distcp").write_bytes(b"cut short")
    _save(folder, range(1, 2))
    assert layout.complete_steps(folder) == [1]
    (store / "step-2" / "notes.txt").write_bytes(b"mine")
    with pytest.raises(CheckpointError, match=r"cannot save into .*step-2: it holds files a save does not "
                                              r"write \(notes.txt\); .* left as it is: move it away"):
        _save(folder, range(2, 3))
    assert (store / "step-2" / "notes.txt").read_bytes() == b"mine"


def test_on_a_folder_links_and_files_named_like_checkpoints_are_ignored_by_name(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint"
    _save(folder, range(1, 3))
    other = tmp_path / "other"
    _save(other, range(5, 6))
    (folder / "step-999").symlink_to(other / "step-5")
    (folder / "step-7").write_text("notes\n")
    (folder / "step-8").symlink_to(tmp_path / "nowhere")
    (folder / "step-9").symlink_to(folder / "step-9")
    (folder / "step-6").mkdir()  # a real folder without .metadata: damaged, refused when it would be picked
    found = layout.scan(folder)
    assert found.complete == [1, 2] and found.damaged == [6]
    assert sorted(line.split(" is ")[0] for line in found.ignored) == [
        str(folder / name) for name in ("step-7", "step-8", "step-9", "step-999")]
    with pytest.raises(CheckpointError, match="step-6 is incomplete"):
        layout.resolve_checkpoint(folder)
    (folder / "step-6").rmdir()
    assert layout.resolve_checkpoint(folder) == folder / "step-2"
    # keep_latest_k 1: step-1 and step-2 go, every entry above stays as it was.
    _save(folder, range(3, 4), keep_latest_k=1)
    assert sorted(entry.name for entry in folder.iterdir()) == ["step-3", "step-7", "step-8", "step-9", "step-999"]
    assert os.readlink(folder / "step-999") == str(other / "step-5") and (other / "step-5" / ".metadata").is_file()


def test_a_symlink_in_the_way_of_a_save_is_refused_not_removed(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "step-1.partial").symlink_to(tmp_path)
    with pytest.raises(CheckpointError, match=r"step-1.partial: it is not a folder \(a symlink or a file\)"):
        _save(folder, range(1, 2))
    assert (folder / "step-1.partial").is_symlink()


def test_signature_key_from_the_named_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert integrity.signing_key("") is None
    monkeypatch.delenv("TTRNG_TEST_KEY", raising=False)
    with pytest.raises(CheckpointError, match=r"signed with the key in \$TTRNG_TEST_KEY, but \$TTRNG_TEST_KEY is "
                                              "not set"):
        integrity.signing_key("TTRNG_TEST_KEY")
    monkeypatch.setenv("TTRNG_TEST_KEY", "k")
    assert integrity.signing_key("TTRNG_TEST_KEY") == integrity.SigningKey("TTRNG_TEST_KEY", b"k")


def test_a_signed_checkpoint_on_s3_is_refused_when_changed_and_resigned_without_the_key() -> None:
    key, other_key = integrity.SigningKey("K", b"secret"), integrity.SigningKey("K", b"another")
    with s3_server("unit") as _:
        folder = "s3://unit/run/checkpoint"
        _save(folder, range(1, 2), signing=key)
        checkpoint = locate(f"{folder}/step-1")
        assert integrity.verify_signature(checkpoint, key) == []  # control: untouched, the key accepts it
        assert "is signed, and no signing key was given" in integrity.verify_signature(checkpoint, None)[0]
        with pytest.raises(CheckpointError, match="checksums.json does not match its signature under the key in \\$K"):
            integrity.verify_signature(checkpoint, other_key)
        # Tampered: a shard changed, checksums.json rewritten to match it, the signature left.
        shard = checkpoint / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[-100] ^= 0x01
        shard.write_bytes(bytes(data))
        signature = (checkpoint / integrity.SIGNATURE_NAME).read_bytes()
        integrity.write_checksums(checkpoint)
        (checkpoint / integrity.SIGNATURE_NAME).write_bytes(signature)
        assert integrity.verify_integrity(checkpoint)  # the checksums alone cannot tell
        with pytest.raises(CheckpointError, match=rf"checkpoint {folder}/step-1 is refused: checksums.json does not "
                                                  "match its signature"):
            integrity.verify_signature(checkpoint, key)
        s3().rm("unit/run/checkpoint/step-1/" + integrity.SIGNATURE_NAME)
        with pytest.raises(CheckpointError, match="it has no signature.json"):
            integrity.verify_signature(checkpoint, key)


def test_the_launcher_check_refuses_a_url_without_its_backend_in_one_line(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    from torchtitan_rng.launch import preflight

    config = str(Path(__file__).resolve().parents[2] / "train_configs" / "llama_debug.toml")
    code = preflight.main(["--job.config_file", config, "--job.dump_folder", str(tmp_path / "run"),
                           "--checkpoint.enable", "--checkpoint.folder", "gs://bucket/run"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: gs://bucket/run is on gs://") and "pip install 'torchtitan_rng[gcs]'" in err


def test_exact_resume_saves_to_and_loads_from_a_url() -> None:
    from tests.support.tiny_loop import STEPS, tiny_loop, train_tiny_loop

    folder = _memory_folder()
    with tiny_loop(folder) as exact:
        train_tiny_loop(exact)
    assert layout.complete_steps(folder) == [STEPS]
    with tiny_loop(folder) as again:
        assert again.load() == STEPS and again.loaded_from == locate(folder) / f"step-{STEPS}"
