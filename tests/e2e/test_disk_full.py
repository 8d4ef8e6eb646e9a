"""A really full disk, at start and during training, with 2 processes under the launcher: one line, exit 2,
nothing of the user's renamed or deleted, and the next run is not blocked (it resumes exactly once space is back).

The disk is a small tmpfs mounted over the dump folder in a user and mount namespace of its own
(``unshare --user --map-root-user --mount``): no root needed, nothing to unmount, and the writes fail with the
real ENOSPC at the real write calls. The namespace ends with its script, so the script records what the
tests check (exit codes, output, listings, a copy of the checkpoints) outside the tmpfs.
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checks import assert_every_line_matches
from tests.support.launch import REPO, run_env
from torchtitan_rng.checkpoint.integrity import verify_integrity
from torchtitan_rng.checkpoint.layout import complete_steps
from torchtitan_rng.launch.run_lock import LOCK_NAME

pytestmark = pytest.mark.slow  # a full filesystem in a user namespace (CI runs the slow tier)

CONFIG = REPO / "train_configs" / "llama_debug.toml"
# 4 steps on the 20-step curve of the session's uninterrupted 2-process run; saves at 2 and 4 (about 2.1 MB
# each). The disk: 3500 KiB, 512 KiB of them the user's own file: after the first save no room for a second.
RUN = ("--training.steps", "4", "--lr_scheduler.total_steps", "20", "--checkpoint.enable", "--checkpoint.interval",
       "2", "--metrics.log_freq", "1")
USER_FILE = 512 * 1024


def _commands(dump: Path) -> dict[str, str]:
    trainer = ["-m", "torchtitan_rng.train", "--job.config_file", str(CONFIG), "--job.dump_folder", str(dump), *RUN]
    launcher = ["-m", "torchtitan_rng.launch.launcher", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
                "--local-ranks-filter", "0", "--role", "rank", "--tee", "3", "--module", *trainer[1:]]
    return {"one": shlex.join([sys.executable, *trainer]), "two": shlex.join([sys.executable, *launcher])}


SCRIPT = """
set -u
run() {{ name=$1; shift; "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"; echo $? > "$OUT/$name.rc"; }}
mount -t tmpfs -o size=3500k tmpfs "$DUMP"
head -c {user_file} /dev/urandom > "$DUMP/notes.bin"
sha256sum < "$DUMP/notes.bin" > "$OUT/notes.before"
dd if=/dev/zero of="$DUMP/scratch" bs=64k 2> /dev/null   # the disk is full
run start_one {one}
run start_two {two}
ls -A "$DUMP" > "$OUT/after_start"
rm "$DUMP/scratch"                                     # the user frees some space
run during {two}
ls -A "$DUMP" "$DUMP/checkpoint" > "$OUT/after_during"
cp -a "$DUMP/checkpoint" "$OUT/checkpoint_after_during"
mount -o remount,size=16m "$DUMP"                      # and then enough
run resumed {two}
sha256sum < "$DUMP/notes.bin" > "$OUT/notes.after"
cp -a "$DUMP/checkpoint" "$DUMP/loss_log.jsonl" "$OUT/"
"""


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("disk_full")
    dump = out / "dump"
    dump.mkdir()
    script = out / "script.sh"
    script.write_text(SCRIPT.format(user_file=USER_FILE, **_commands(dump)))
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "bash", str(script)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=run_env({"DUMP": str(dump), "OUT": str(out)}))
    assert proc.returncode == 0 and (out / "resumed.rc").exists(), (proc.stdout, proc.stderr)
    return out


def _one_line(out: Path, name: str, *fragments: str) -> str:
    """Exit 2 and one line on stderr (rank 0's, tagged by torchrun, or the process's own), no traceback."""
    assert (out / f"{name}.rc").read_text().strip() == "2", ((out / f"{name}.out").read_text()[-2000:],
                                                           (out / f"{name}.err").read_text()[-3000:])
    err = (out / f"{name}.err").read_text()
    assert "Traceback" not in err + (out / f"{name}.out").read_text()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].removeprefix("[rank0]:").startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_full_at_start_says_so_and_leaves_no_lock(full: Path) -> None:
    dump = full / "dump"
    for name in ("start_one", "start_two"):  # rank 0 takes the lock / the launcher does
        _one_line(full, name, f"could not write the run lock {dump / LOCK_NAME}: the disk is full")
    assert (full / "after_start").read_text().split() == ["notes.bin", "scratch"]  # no lock file left behind


def test_full_during_a_save_says_so_once_with_exit_2(full: Path) -> None:
    _one_line(full, "during", f"saving step 4 into {full / 'dump' / 'checkpoint'} failed: the disk is full",
              "complete checkpoints there are kept")
    listing = (full / "after_during").read_text().split()
    assert LOCK_NAME not in listing and "notes.bin" in listing
    checkpoints = full / "checkpoint_after_during"
    assert complete_steps(checkpoints) == [2] and verify_integrity(checkpoints / "step-2")
    assert (checkpoints / "step-4.partial").is_dir()  # never picked


def test_next_run_resumes_exactly_and_the_users_file_is_untouched(full: Path,
                                                                   llama_uninterrupted_two_processes: Path) -> None:
    assert (full / "resumed.rc").read_text().strip() == "0", (full / "resumed.err").read_text()[-3000:]
    assert f"resumed from {full / 'dump' / 'checkpoint' / 'step-2'}" in (full / "resumed.out").read_text()
    assert complete_steps(full / "checkpoint") == [2, 4]
    assert (full / "notes.before").read_text() == (full / "notes.after").read_text()
    assert_every_line_matches(llama_uninterrupted_two_processes, full)
    # Control: the comparison is bitwise: the same log with one loss one ulp off is caught.
    other = full / "control"
    other.mkdir()
    records = [json.loads(line) for line in (full / "loss_log.jsonl").read_text().splitlines()]
    records[-1]["loss"] = math.nextafter(records[-1]["loss"], math.inf)
    (other / "loss_log.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    with pytest.raises(AssertionError, match=f"step {records[-1]['step']}:"):
        assert_every_line_matches(llama_uninterrupted_two_processes, other)
