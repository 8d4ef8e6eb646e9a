"""What the run did not write is never lost or written over, and the folder a user names is where the checkpoints
are: a checkpoint folder that is a symlink, a user's file inside a step folder at pruning, a user's copy under
another step's name, two dump folders on one checkpoint folder, a store checkpoint without checksums. On a local
folder, fsspec's in-memory store and a real S3-compatible server on this machine (moto)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.object_store import s3, s3_server
from torchtitan_rng import resume
from torchtitan_rng.checkpoint import integrity, layout, owner
from torchtitan_rng.checkpoint.manager import CheckpointManager
from torchtitan_rng.checkpoint.states import ModelState
from torchtitan_rng.checkpoint.storage import checkpoint_folder, locate
from torchtitan_rng.checkpoint.vetting import vet
from torchtitan_rng.config import parse_args
from torchtitan_rng.errors import CheckpointError, ConfigError
from torchtitan_rng.launch import preflight

CONFIG = str(Path(__file__).resolve().parents[2] / "train_configs" / "llama_debug.toml")


def _save(folder: object, steps: range, record: dict | None = None, **options: object) -> list[str]:
    """Save a small model at each step of ``steps`` into ``folder``; returns the manager's log lines."""
    said: list[str] = []
    manager = CheckpointManager(folder, {"model": ModelState(torch.nn.Linear(4, 4))}, interval=1, log=said.append,
                                **options)
    manager.run_record = record or {"config": {}}
    for step in steps:
        manager.save(step, last_step=steps[-1])
    manager.close()
    return said


def _config(dump: Path, *flags: str) -> object:
    return parse_args(["--job.config_file", CONFIG, "--job.dump_folder", str(dump), "--checkpoint.enable", *flags])


def test_a_checkpoint_folder_that_is_a_symlink_is_where_the_checkpoints_are(tmp_path: Path) -> None:
    """DUMP/checkpoint -> /bigger/disk/run1: saves and the next start's reading go through the link; a link
    inside it stays unfollowed. Control: the link's target itself is found alike."""
    dump, disk = tmp_path / "run1", tmp_path / "bigger" / "run1"
    dump.mkdir()
    disk.mkdir(parents=True)
    (dump / "checkpoint").symlink_to(disk)
    folder = checkpoint_folder(dump, "checkpoint")
    _save(folder, range(1, 3))
    assert sorted(path.name for path in disk.iterdir()) == ["step-1", "step-2"]
    other = tmp_path / "other"
    _save(other, range(7, 8))
    (disk / "step-9").symlink_to(other / "step-7")
    again = checkpoint_folder(dump, "checkpoint")  # the next launch
    assert layout.complete_steps(again) == [1, 2] == layout.complete_steps(disk)
    assert layout.resolve_checkpoint(again) == disk / "step-2"
    assert "step-9 is a symlink or special file" in layout.ignored_entries(again)[0]
    _save(again, range(3, 4), keep_latest_k=1)  # the next save, and a prune, through the link
    assert sorted(path.name for path in disk.iterdir()) == ["step-3", "step-9"] and (dump / "checkpoint").is_symlink()
    assert (other / "step-7" / layout.METADATA_NAME).is_file()


@pytest.mark.parametrize("where", ["local", "memory"])
def test_pruning_keeps_a_step_holding_a_file_the_run_did_not_write(tmp_path: Path, where: str) -> None:
    folder = str(tmp_path / "checkpoint") if where == "local" else f"memory://prune-{uuid.uuid4().hex}/checkpoint"
    _save(folder, range(1, 3))
    note = locate(folder) / "step-1" / "notes" / "mine.txt"
    note.write_bytes(b"a user's note")
    said = _save(folder, range(3, 5), keep_latest_k=1)
    assert layout.complete_steps(folder) == [1, 4]  # control: step-2 and step-3 were pruned
    assert note.read_bytes() == b"a user's note" and integrity.verify_files(locate(folder) / "step-1",
                                                                              [layout.METADATA_NAME])
    kept = [line for line in said if "kept by keep_latest_k" in line]
    assert len(kept) == 1 and "holds files a save does not write (notes/mine.txt)" in kept[0]


def test_a_copy_under_another_steps_name_is_refused_at_start_locally(tmp_path: Path) -> None:
    """step-5 copied to step-15: a run that would save step 15 is refused before it trains (locally the save
    would fail at the rename, after training); control: a run that stops before 15 is not."""
    import shutil

    folder = tmp_path / "checkpoint"
    _save(folder, range(5, 6))
    shutil.copytree(folder / "step-5", folder / "step-15")
    before = sorted(path.name for path in (folder / "step-15").iterdir())
    with pytest.raises(CheckpointError, match=r"^this run saves step 15: cannot save into .*/step-15: it holds a "
                                              r"checkpoint saved as step 5 \(a copy\); it is not this run's, so it "
                                              r"is left as it is: move it away$"):
        layout.refuse_overwrite(folder, [10, 15, 20])
    layout.refuse_overwrite(folder, [10, 14])
    with pytest.raises(CheckpointError, match="cannot save into .*/step-15: it holds a checkpoint saved as step 5"):
        _save(folder, range(15, 16))
    assert sorted(path.name for path in (folder / "step-15").iterdir()) == before


def test_a_copy_under_another_steps_name_on_s3_is_never_written_over(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    with s3_server("own") as _:
        url = "s3://own/run/checkpoint"
        _save(url, range(5, 6))
        fs = s3()
        fs.copy("own/run/checkpoint/step-5", "own/run/checkpoint/step-15", recursive=True)
        copied = {path: fs.cat_file(path) for path in fs.find("own/run/checkpoint/step-15")}
        flags = ["--job.config_file", CONFIG, "--job.dump_folder", str(tmp_path / "fresh"), "--checkpoint.enable",
                 "--checkpoint.folder", url, "--checkpoint.interval", "5", "--training.steps", "20"]
        # Foreseen at start: a run resumed at step 5 whose saves include step 15 (checked once the step is
        # loaded)...
        with pytest.raises(CheckpointError, match=f"^this run saves step 15: cannot save into {url}/step-15"):
            resume.refuse_overwrite(parse_args(flags), 5)
        resume.refuse_overwrite(parse_args([*flags, "--training.steps", "14"]), 5)  # control: no save at 15
        # ...and a fresh start (only the copy there), refused by the launcher's check in one line.
        fs.rm("own/run/checkpoint/step-5", recursive=True)
        code = preflight.main(flags)
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"error: this run saves step 15: cannot save into {url}/step-15: it holds a "
                              "checkpoint saved as step 5 (a copy)")
        with pytest.raises(CheckpointError, match="cannot save into .*step-15: it holds a checkpoint saved as step 5"):
            _save(url, range(15, 16))
        s3().invalidate_cache()
        assert {path: fs.cat_file(path) for path in s3().find("own/run/checkpoint/step-15")} == copied


def test_two_dump_folders_on_one_checkpoint_folder_are_refused_or_named(tmp_path: Path) -> None:
    """run.json records which dump folder wrote a checkpoint: another dump folder on the same checkpoint folder
    (here an absolute local folder) is refused, or warned about where allowed; the run that wrote it, and a
    checkpoint folder inside the dump folder (moved with it), go on."""
    shared = tmp_path / "shared_checkpoints"
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()  # the run that wrote the checkpoints is there (a moved one is named as such: below)
    config = _config(first, "--checkpoint.folder", f"file://{shared}")
    _save(shared, range(4, 5), record=resume.build_record(config, []))
    checkpoint = shared / "step-4"
    assert resume.refuse_another_runs(config, checkpoint) == []
    with pytest.raises(CheckpointError, match=(
            rf"^checkpoint {checkpoint} was written by the run of dump folder {first}, not this one \({second}\): "
            rf"both keep checkpoints in {shared}; resume that run with --job.dump_folder {first}, give this run its "
            r"own --checkpoint.folder, or pass --checkpoint.allow_config_change job.dump_folder to continue that "
            r"run's checkpoints from this dump folder$")):
        resume.refuse_another_runs(_config(second, "--checkpoint.folder", f"file://{shared}"), checkpoint)
    allowed = resume.refuse_another_runs(_config(second, "--checkpoint.folder", f"file://{shared}",
                                                 "--checkpoint.allow_config_change", "job.dump_folder"), checkpoint)
    assert len(allowed) == 1 and allowed[0].startswith(f"WARNING: checkpoint {checkpoint} was written by the run "
                                                       f"of dump folder {first}")
    # A dump folder moved (its checkpoint folder inside it): the same run.
    inside = _config(first)
    _save(first / "checkpoint", range(2, 3), record=resume.build_record(inside, []))
    (first).rename(tmp_path / "moved")
    assert resume.refuse_another_runs(_config(tmp_path / "moved"), tmp_path / "moved" / "checkpoint" / "step-2") == []


def test_a_run_without_checkpointing_names_where_the_checkpoints_are(tmp_path: Path) -> None:
    """checkpoint.enable off over a checkpoint folder elsewhere (a URL) that holds checkpoints: the refusal
    names that folder, not the dump folder that does not hold them."""
    url = f"memory://shared-{uuid.uuid4().hex}/checkpoint"
    _save(url, range(5, 6))
    dump = tmp_path / "control"
    config = parse_args(["--job.config_file", CONFIG, "--job.dump_folder", str(dump), "--checkpoint.folder", url])
    with pytest.raises(ConfigError, match=rf"^checkpoint folder {locate(url)} already holds a run \(checkpoints 5\) "
                                          r"and checkpoint.enable is off"):
        preflight.refuse_restart_over_history(config)


def test_a_store_checkpoint_without_checksums_is_named_unsigned_and_unchecked() -> None:
    folder = f"memory://unsigned-{uuid.uuid4().hex}/checkpoint"
    _save(folder, range(1, 2))
    checkpoint = locate(folder) / "step-1"
    (checkpoint / layout.CHECKSUMS_NAME).remove()
    warnings = vet(checkpoint, layout=lambda info: False, record=None).warnings
    assert warnings == [f"WARNING: checkpoint {checkpoint} is unsigned and unchecked: it has no checksums.json (its "
                        "checksums.json was removed or never written), so damage to its files cannot be detected"]


@pytest.fixture(params=["local", "s3"])
def shared_folder(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A checkpoint folder two runs may name: an absolute local folder, or a prefix on a real S3 server."""
    if request.param == "local":
        yield str(tmp_path / "shared_checkpoints")
        return
    bucket = f"shared-{uuid.uuid4().hex[:12]}"
    with s3_server(bucket):
        yield f"s3://{bucket}/team/checkpoint"


def _runs(tmp_path: Path, folder: str) -> tuple[Path, Path]:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    return first, second


def test_a_checkpoint_folder_belongs_to_the_first_run_that_starts_with_it(
        tmp_path: Path, shared_folder: str, capsys: pytest.CaptureFixture) -> None:
    """Two fresh runs (two dump folders) name one checkpoint folder: the second is refused before it trains, with
    the advice for a second run; the first goes on (the control)."""
    first, second = _runs(tmp_path, shared_folder)
    assert resume.claim_folder(_config(first, "--checkpoint.folder", shared_folder)) == []
    folder = locate(shared_folder)
    refusal = (f"checkpoint folder {folder} belongs to the run of dump folder {first} (its owner.json), not this one "
               f"({second}): two runs saving into one folder write over each other's checkpoints; give this run its "
               f"own --checkpoint.folder, or resume that run with --job.dump_folder {first}")
    flags = ["--job.config_file", CONFIG, "--job.dump_folder", str(second), "--checkpoint.enable",
             "--checkpoint.folder", shared_folder]
    assert preflight.main(flags) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"error: {refusal}"
    with pytest.raises(CheckpointError) as err:
        resume.claim_folder(_config(second, "--checkpoint.folder", shared_folder))
    assert str(err.value) == refusal
    assert resume.claim_folder(_config(first, "--checkpoint.folder", shared_folder)) == []  # its own, again
    assert owner.owner_of(folder) == str(first)


def test_runs_claiming_one_folder_at_once_find_one_owner(tmp_path: Path, shared_folder: str) -> None:
    """Eight claims released together by a barrier: exactly one creates the record, and every one reads it."""
    folder = locate(shared_folder)
    start = threading.Barrier(8)
    found: list[str] = []

    def claim(number: int) -> None:
        start.wait()
        found.append(owner.claim(folder, f"/runs/{number}"))

    threads = [threading.Thread(target=claim, args=(number,)) for number in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(found) == 8 and len(set(found)) == 1 and found[0] == owner.owner_of(folder)


def test_a_second_saver_of_the_same_step_is_refused_and_the_first_checkpoint_stays_whole(
        tmp_path: Path, shared_folder: str) -> None:
    """Two runs' managers on one folder, each saving step 5: the second is refused at its save (a run whose start
    did not claim the folder: checkpoint.enable off, a stop signal saves), the first's checkpoint is complete."""
    model = {"model": ModelState(torch.nn.Linear(4, 4))}
    one = CheckpointManager(shared_folder, model, interval=5, owner="/runs/first")
    other = CheckpointManager(shared_folder, model, interval=5, owner="/runs/second")
    one.save(5)
    with pytest.raises(CheckpointError, match=r"^saving step 5 into .* refused: that folder belongs to the run of dump "
                                              r"folder /runs/first \(owner.json\)"):
        other.save(5)
    checkpoint = locate(shared_folder) / "step-5"
    assert layout.holds_step(checkpoint, 5) and integrity.verify_integrity(checkpoint)
    one.save(10)  # control: the owner's next save goes through
    assert layout.complete_steps(shared_folder) == [5, 10]


class _AnotherWriter:
    """Save hooks: between the save's completion and its report, another process removes the step's index (as a
    second run clearing "its" unfinished save did)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def at(self, point: str, step: int) -> None:
        if point == "save_renamed":
            (locate(self.folder) / f"step-{step}" / layout.METADATA_NAME).remove()

    def save_planner(self, step: int) -> None:
        return None


def test_a_save_is_never_reported_for_a_step_it_did_not_leave_complete(tmp_path: Path, shared_folder: str) -> None:
    said: list[str] = []
    manager = CheckpointManager(shared_folder, {"model": ModelState(torch.nn.Linear(4, 4))}, interval=1,
                                log=said.append, hooks=_AnotherWriter(shared_folder))
    with pytest.raises(CheckpointError, match=r"^saving step 1 into .* failed: .*/step-1 is not complete after the "
                                              r"save \(no \.metadata or complete\.json of step 1\): another process "
                                              "writes into this folder"):
        manager.save(1)
    assert not any("saved" in line for line in said), said
    _save(f"{shared_folder}/control", range(1, 2))  # control: the same save, untouched, reports and counts
    assert layout.complete_steps(f"{shared_folder}/control") == [1]


def test_a_moved_run_folder_is_named_as_moved_and_goes_on_where_allowed(tmp_path: Path) -> None:
    """A dump folder whose checkpoint folder is a symlink to an absolute folder, moved: one run, moved (its
    records name the old place); the documented way on hands the folder over, with a WARNING."""
    dump, disk = tmp_path / "run", tmp_path / "disk" / "run"
    dump.mkdir()
    disk.mkdir(parents=True)
    (dump / "checkpoint").symlink_to(disk)
    config = _config(dump)
    assert resume.claim_folder(config) == []
    _save(resume.folder_of(config), range(5, 6), record=resume.build_record(config, []))
    moved = tmp_path / "moved"
    dump.rename(moved)
    with pytest.raises(CheckpointError) as err:
        resume.check_owner(_config(moved))
    assert str(err.value) == (f"checkpoint folder {disk} belongs to the run of dump folder {dump}, which no longer "
                              f"exists: if this dump folder ({moved}) is that run, moved, pass "
                              "--checkpoint.allow_config_change job.dump_folder to go on from its checkpoints here; "
                              "otherwise give this run its own --checkpoint.folder")
    allowed = _config(moved, "--checkpoint.allow_config_change", "job.dump_folder")
    said = resume.claim_folder(allowed)
    assert said == [f"WARNING: checkpoint folder {disk} belonged to the run of dump folder {dump}; it belongs to this "
                    f"one ({moved}) from now on, as checkpoint.allow_config_change allows job.dump_folder"]
    assert owner.owner_of(locate(disk)) == str(moved)
    assert resume.claim_folder(_config(moved)) == []  # from now on its own
    with pytest.raises(CheckpointError, match="which no longer exists: if this dump folder"):  # the checkpoint's
        resume.refuse_another_runs(_config(moved), disk / "step-5")  # record still names the old place


@pytest.mark.parametrize("kind", ["loop", "to-a-file", "file"])
def test_a_checkpoint_folder_that_cannot_hold_checkpoints_is_refused_at_start(tmp_path: Path, kind: str,
                                                                              capsys: pytest.CaptureFixture) -> None:
    """DUMP/checkpoint a symlink loop, a link to a file, or a file: refused before the run trains, naming the link
    (once it trained until its first save, then blamed step-N.partial). Control: a dangling link is a folder the
    first save creates."""
    dump = tmp_path / "run"
    dump.mkdir()
    link = dump / "checkpoint"
    if kind == "loop":
        link.symlink_to(link)
        expected = f"checkpoint folder {link} is a symlink loop ({link} -> {link}), not a folder"
    elif kind == "to-a-file":
        (tmp_path / "notes.txt").write_text("a user's file")
        link.symlink_to(tmp_path / "notes.txt")
        expected = f"checkpoint folder {link} is a symlink to a file ({link} -> {tmp_path / 'notes.txt'}), not a folder"
    else:
        link.write_text("a user's file")
        expected = f"checkpoint folder {link} is a file, not a folder"
    flags = ["--job.config_file", CONFIG, "--job.dump_folder", str(dump), "--checkpoint.enable"]
    assert preflight.main(flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {expected}: ") and "Traceback" not in err, err
    link.unlink()
    link.symlink_to(tmp_path / "disk" / "run")  # the control: nothing there yet
    assert preflight.main(flags) == 0


@pytest.mark.parametrize("below", ["", "/more"], ids=["the-checkpoint", "a-folder-inside-it"])
def test_a_checkpoint_folder_inside_a_complete_checkpoint_is_refused(tmp_path: Path, shared_folder: str,
                                                                     capsys: pytest.CaptureFixture, below: str) -> None:
    """--checkpoint.folder s3://b/u/step-20 (another run's complete checkpoint, or a folder in it): refused at
    start, instead of writing steps into that checkpoint; its files stay as they were."""
    _save(shared_folder, range(20, 21))
    checkpoint = locate(shared_folder) / "step-20"
    before = sorted(checkpoint.files())
    named = f"{shared_folder}/step-20{below}"
    flags = ["--job.config_file", CONFIG, "--job.dump_folder", str(tmp_path / "new"), "--checkpoint.enable",
             "--checkpoint.folder", named]
    assert preflight.main(flags) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    where = "is" if not below else "is inside"
    assert err == (f"error: checkpoint folder {locate(named)} {where} the complete checkpoint {checkpoint}: this "
                   "run's steps would be written into that checkpoint; pass the folder that holds checkpoints, not "
                   f"one of them (or --checkpoint.initial_load_path {checkpoint} to start from it)")
    with pytest.raises(CheckpointError, match="would be written into that checkpoint"):
        resume.claim_folder(_config(tmp_path / "new", "--checkpoint.folder", named))
    assert sorted(checkpoint.files()) == before
    assert preflight.main([*flags[:-1], shared_folder + "/next"]) == 0  # the control: beside it, not inside


def test_a_copied_run_folder_saves_into_its_own_checkpoints(tmp_path: Path) -> None:
    """A dump folder copied elsewhere, its checkpoint folder inside it (owner.json naming the original): the copy's
    start changes nothing there (it may yet be refused), its first save takes the folder over."""
    import shutil

    dump = tmp_path / "run"
    dump.mkdir()
    assert resume.claim_folder(_config(dump)) == []
    model = {"model": ModelState(torch.nn.Linear(4, 4))}
    CheckpointManager(dump / "checkpoint", model, interval=5, owner=str(dump)).save(5)
    copy = tmp_path / "copy"
    shutil.copytree(dump, copy)
    config = _config(copy)
    assert resume.claim_folder(config) == []
    assert owner.owner_of(locate(copy / "checkpoint")) == str(dump)  # untouched at start
    CheckpointManager(copy / "checkpoint", model, interval=5, owner=resume.owner_of(config)).save(10)
    assert layout.complete_steps(copy / "checkpoint") == [5, 10]
    assert owner.owner_of(locate(copy / "checkpoint")) == str(copy)
    assert owner.owner_of(locate(dump / "checkpoint")) == str(dump)  # the original's stays its own
