"""Checkpoints on an object store (a real S3-compatible server on this machine, moto's server mode) and
"only what the run wrote counts", on the store and on a local folder.

One 2-process run signed with an HMAC key saves into ``s3://`` (asynchronously, ``keep_latest_k 2``) and
stops at step 4; a second is killed by fault injection while uploading step 6; a third resumes and runs to
step 8. Every logged loss equals the uninterrupted run's bit for bit. Beside the third, an unsigned run
starts from a copy of step 4 (``initial_load_path``, a URL) whose weights were changed and whose checksums.json was rewritten: it is
accepted (nothing can tell) and its loss is not the reference's: the control of the comparison, and what the
signature is for; and a one-process run resumes a local folder among symlinks and files named step-N that it
did not write. Refusals (tampered and signed, damaged, key missing) need no training: the launcher's
preflight refuses before any rank starts.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.checks import assert_every_line_matches, assert_refused, rewrite_checkpoint
from tests.support.launch import together, train
from tests.support.object_store import s3, s3_server
from torchtitan_rng import samples
from torchtitan_rng.checkpoint import integrity, layout, run_record
from torchtitan_rng.checkpoint.owner import OWNER_NAME
from torchtitan_rng.fault_injection import ENV_VAR as FAULT_ENV

# The slow tier, which CI runs: the everyday suite saves into and loads from the same kind of server in
# tests/unit/test_storage.py, test_store_failures.py and test_checkpoint_ownership.py.
pytestmark = pytest.mark.slow

KEY_ENV = "TEST_CHECKPOINT_KEY"
BUCKET = "ckpt"
RUN = f"s3://{BUCKET}/run/checkpoint"
# The reference (llama_uninterrupted_two_processes) trains 20 steps: the runs here pin that horizon.
COMMON = ("--checkpoint.enable", "--checkpoint.interval", "2", "--lr_scheduler.total_steps", "20")
STORE = ("--checkpoint.folder", RUN, "--checkpoint.async_mode", "async", "--checkpoint.keep_latest_k", "2")
SIGNED = ("--checkpoint.signing_key_env", KEY_ENV)
# Entries of the run's prefix that the run did not write (added before the last run): never loaded or pruned.
FOREIGN_COPY, FOREIGN_FILE = "step-999", "step-998"


def _samples(dump: Path, *args: str) -> tuple[int, str, str]:
    """``python -m torchtitan_rng.samples DUMP --step 6 --json ARGS``, in this process (which reaches the store)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = samples.main([str(dump), "--step", "6", "--json", *args])
    return code, out.getvalue(), err.getvalue()


def _download(url: str, local: Path) -> None:
    s3().get(url.removeprefix("s3://"), str(local), recursive=True)


def _upload(local: Path, url: str) -> None:
    s3().put(str(local), url.removeprefix("s3://"), recursive=True)


def _tamper(checkpoint: str, into: str, scratch: Path) -> None:
    """What someone who can write to the bucket but has no key can do: change a weight and rewrite
    checksums.json to match, leaving the signature as it was; the result goes to ``into``."""
    local = scratch / "tampered"
    _download(checkpoint, local)
    keep = {name: (local / name).read_bytes() for name in (run_record.RECORD_NAME, integrity.SIGNATURE_NAME,
                                                            layout.MARKER_NAME)}

    def edit(state: dict) -> None:
        # Scaled, not shifted: a constant added to every weight of some layers leaves the loss as it was.
        name = next(key for key in sorted(state["model"]) if key.endswith("attn.qkv.weight"))
        state["model"][name].mul_(1.01)

    rewrite_checkpoint(local, scratch, edit)
    for name, data in keep.items():
        (local / name).write_bytes(data)
    (local / integrity.CHECKSUMS_NAME).unlink(missing_ok=True)
    signature = (local / integrity.SIGNATURE_NAME).read_bytes()
    (local / integrity.SIGNATURE_NAME).unlink()
    integrity.write_checksums(local)  # unsigned: no key
    (local / integrity.SIGNATURE_NAME).write_bytes(signature)
    _upload(local, into)


def _foreign_entries(dump: Path, elsewhere: Path) -> dict[str, str]:
    """Put into a dump folder's checkpoint folder what a person might: a symlink step-999 to another run's
    checkpoint, a file, a dangling link and a link loop named step-N. Returns the links' targets."""
    folder = dump / "checkpoint"
    shutil.copytree(folder / "step-2", elsewhere / "step-20")
    (folder / "step-999").symlink_to(elsewhere / "step-20")
    (folder / "step-7").write_text("notes\n")
    (folder / "step-8").symlink_to(elsewhere / "nowhere")
    (folder / "step-9").symlink_to(folder / "step-9")
    return {name: os.readlink(folder / name) for name in ("step-999", "step-8", "step-9")}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, llama_uninterrupted_two_processes: Path, saved: Path) -> dict:
    """The runs above, on one S3 server, and beside them a local run among entries it did not write; the
    facts the tests check, recorded as they happen."""
    root = tmp_path_factory.mktemp("object_storage")
    dump, tampered_dump, local_dump = root / "run", root / "tampered_run", root / "local_run"
    shutil.copytree(saved, local_dump)
    links = _foreign_entries(local_dump, root / "other_run")
    with s3_server(BUCKET) as env:
        env = {**env, KEY_ENV: "a secret of this run"}
        facts: dict = {"env": env, "root": root, "reference": llama_uninterrupted_two_processes}
        facts["first"] = train(dump, "--training.steps", "4", *COMMON, *STORE, *SIGNED, nproc=2, env=env)
        facts["after_first"] = layout.scan(RUN)
        facts["killed"] = train(dump, "--training.steps", "8", *COMMON, *STORE, *SIGNED, nproc=2,
                                env={**env, FAULT_ENV: "save_writing:6:1"}, check=False)
        facts["after_kill"] = layout.scan(RUN)

        fs = s3()
        fs.copy(f"{BUCKET}/run/checkpoint/step-4", f"{BUCKET}/run/checkpoint/{FOREIGN_COPY}", recursive=True)
        fs.pipe_file(f"{BUCKET}/run/checkpoint/{FOREIGN_FILE}", b"a user's note\n")
        tampered = f"s3://{BUCKET}/tampered/checkpoint"
        _tamper(f"{RUN}/step-4", f"{tampered}/step-4", root)
        damaged = f"s3://{BUCKET}/damaged/checkpoint"
        fs.copy(f"{BUCKET}/run/checkpoint/step-4", f"{BUCKET}/damaged/checkpoint/step-4", recursive=True)
        shard = f"{BUCKET}/damaged/checkpoint/step-4/__1_0.distcp"
        data = bytearray(fs.cat_file(shard))
        data[len(data) // 2] ^= 0x01
        fs.pipe_file(shard, bytes(data))

        facts["resumed"], facts["unsigned_tampered"], facts["local"] = together(
            lambda: train(dump, "--training.steps", "8", *COMMON, *STORE, *SIGNED, nproc=2, env=env),
            lambda: train(tampered_dump, "--training.steps", "6", *COMMON, "--checkpoint.initial_load_path",
                          f"{tampered}/step-4", nproc=2, env=env),
            # The saved run's horizon (tests/support/launch.STEP2); keep_latest_k 1 prunes step-2 at step 4.
            lambda: train(local_dump, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2",
                          "--lr_scheduler.total_steps", "4", "--checkpoint.keep_latest_k", "1"))
        facts["links"], facts["saved"] = links, saved
        facts["after_resume"] = layout.scan(RUN)
        facts["samples"] = {where: _samples(dump, *where) for where in [(), ("--checkpoint.folder", RUN)]}
        facts["objects"] = sorted(s3().find(f"{BUCKET}/run/checkpoint"))
        launch = {"nproc": 2, "check": False}
        facts["signed_tampered"], facts["damaged"], facts["no_key"], facts["second"], facts["control"] = together(
            lambda: train(root / "t2", "--training.steps", "5", *COMMON, "--checkpoint.folder", tampered, *SIGNED,
                          env=env, **launch),
            lambda: train(root / "d", "--training.steps", "5", *COMMON, "--checkpoint.folder", damaged, env=env,
                          **launch),
            lambda: train(root / "k", "--training.steps", "5", *COMMON, *STORE, *SIGNED,
                          env={name: value for name, value in env.items() if name != KEY_ENV}, **launch),
            # Another dump folder on the run's prefix: with checkpointing, and without (a control run).
            lambda: train(root / "second", "--training.steps", "10", *COMMON, *STORE, *SIGNED, env=env, **launch),
            lambda: train(root / "control", "--training.steps", "10", "--checkpoint.folder", RUN, env=env,
                          **launch))
        facts["urls"] = {"tampered": tampered, "damaged": damaged}
        yield facts


def test_stopped_killed_during_upload_and_resumed_on_s3_equals_the_uninterrupted_run(store: dict) -> None:
    assert store["after_first"].complete == [2, 4]
    # Killed while rank 1 uploaded step 6: step-6 is there, unmarked, and never picked.
    killed = store["killed"]
    assert killed.returncode != 0
    assert store["after_kill"].complete == [2, 4] and store["after_kill"].unfinished == [6]
    resumed = store["resumed"]
    assert f"resumed from {RUN}/step-4 at step 4" in resumed.stdout
    assert_every_line_matches(store["reference"], store["root"] / "run")  # steps 5-6 logged twice


def test_samples_reads_a_runs_checkpoints_on_the_store(store: dict) -> None:
    """The run's dump folder holds its loss log only: ``samples`` given the URL (--checkpoint.folder) lists step 6,
    one list of 8 keys per process; without it, one line saying to give it."""
    code, out, err = store["samples"][("--checkpoint.folder", RUN)]
    assert code == 0, err
    assert [len(keys) for keys in json.loads(out)["samples"]] == [8, 8]
    code, out, err = store["samples"][()]
    assert code == 2 and not out and err.count("\n") == 1
    assert "holds no complete checkpoint" in err and "--checkpoint.folder URL" in err


def test_keep_latest_k_prunes_only_complete_checkpoints_the_run_wrote(store: dict) -> None:
    after = store["after_resume"]
    assert after.complete == [6, 8] and after.unfinished == []
    assert f"{BUCKET}/run/checkpoint/{FOREIGN_FILE}" in store["objects"]
    assert f"{BUCKET}/run/checkpoint/{FOREIGN_COPY}/{layout.MARKER_NAME}" in store["objects"]
    assert not any("/step-2/" in name or "/step-4/" in name for name in store["objects"])
    # Named, not loaded: the copy under another step's name, and the file.
    out = store["resumed"].stdout
    assert f"note: {RUN}/{FOREIGN_COPY} holds a checkpoint saved as another step" in out
    assert f"note: {RUN}/{FOREIGN_FILE} is a file, not a checkpoint this run wrote: ignored" in out


def test_tampered_and_resigned_checksums_are_refused_with_the_key(store: dict) -> None:
    url = store["urls"]["tampered"]
    assert_refused(store["signed_tampered"], f"checkpoint {url}/step-4 is refused",
                   f"{integrity.CHECKSUMS_NAME} does not match its signature under the key in ${KEY_ENV}")


def test_control_without_the_key_the_tampered_checkpoint_loads_and_diverges(store: dict) -> None:
    """The same tampered checkpoint, unsigned run: resumed (the rewritten checksums match) and its loss is
    not the reference's. Also the control of the bit-for-bit comparison above."""
    run = store["unsigned_tampered"]
    assert f"resumed from {store['urls']['tampered']}/step-4 at step 4" in run.stdout
    assert "is signed, and no signing key was given" in run.stdout
    with pytest.raises(AssertionError, match=r"step [56]:"):  # the steps after the load
        assert_every_line_matches(store["reference"], store["root"] / "tampered_run")


def test_a_damaged_object_is_refused_naming_it(store: dict) -> None:
    assert_refused(store["damaged"], f"checkpoint {store['urls']['damaged']}/step-4 is damaged",
                   "__1_0.distcp does not match the checksum written at save")


def test_a_missing_signing_key_is_refused(store: dict) -> None:
    assert_refused(store["no_key"], f"checkpoints are signed with the key in ${KEY_ENV}, but ${KEY_ENV} is not set")


def test_another_dump_folder_on_the_runs_prefix_is_refused_naming_where_the_checkpoints_are(store: dict) -> None:
    """The prefix's owner.json says which run it belongs to: a second dump folder resuming the run's prefix is
    refused; one that does not checkpoint is told the checkpoints are on the store, not in its dump folder."""
    root = store["root"]
    assert_refused(store["second"], f"checkpoint folder {RUN} belongs to the run of dump folder {root / 'run'} (its "
                   f"owner.json), not this one ({root / 'second'}): two runs saving into one folder write over each "
                   "other's checkpoints")
    assert_refused(store["control"], f"checkpoint folder {RUN} already holds a run (checkpoints 6, 8) and "
                   "checkpoint.enable is off")
    assert sorted(s3().find(f"{BUCKET}/run/checkpoint")) == store["objects"]  # neither wrote anything


# --- only what the run wrote, on a local folder ---------------------------------------------------------

def test_entries_the_run_did_not_write_are_never_followed_renamed_or_deleted(store: dict) -> None:
    """A symlink step-999 to another run's checkpoint, a file, a dangling link and a link loop named step-N:
    the run resumes from its own step-2, names each, and pruning (keep_latest_k 1) deletes only step-2."""
    folder, other = store["root"] / "local_run" / "checkpoint", store["root"] / "other_run"
    run = store["local"]
    assert f"resumed from {folder / 'step-2'} at step 2" in run.stdout
    for name, what in (("step-999", "a symlink"), ("step-8", "a symlink"), ("step-9", "a symlink"),
                       ("step-7", "a file")):
        assert f"note: {folder / name} is {what}" in run.stdout
    assert sorted(entry.name for entry in folder.iterdir()) == [OWNER_NAME, "step-4", "step-7", "step-8", "step-9",
                                                                "step-999"]
    assert {name: os.readlink(folder / name) for name in store["links"]} == store["links"]
    assert (folder / "step-7").read_text() == "notes\n"
    # The other run's checkpoint behind step-999: still the one copied there.
    assert subprocess.run(["diff", "-r", str(store["saved"] / "checkpoint" / "step-2"),
                           str(other / "step-20")]).returncode == 0
