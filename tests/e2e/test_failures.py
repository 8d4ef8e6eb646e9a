"""Failures of the trainer (``python -m torchtitan_rng.train``) end in one line, promptly, never a traceback:
a full disk during a save (with 2 dataloader workers; the complete checkpoints are kept and the run resumes
exactly once space is back), a dump folder that is a file or not writable, a TrainSpec whose dataset is an
IterableDataset."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.checks import assert_every_line_matches, assert_refused
from tests.support.launch import REPO, run_env, together, train
from torchtitan_rng.checkpoint.integrity import verify_integrity
from torchtitan_rng.checkpoint.layout import complete_steps
from torchtitan_rng.launch.runs import training_command


CONFIG = REPO / "train_configs" / "llama_debug.toml"
# Saves at 2, 4, 6 on one learning-rate curve; 2 workers, whose exit used to hang a failed rank.
COMMON = ("--checkpoint.enable", "--checkpoint.interval", "2", "--lr_scheduler.total_steps", "6",
          "--data.num_workers", "2")
# Above every other file a resumed run writes (loss log, run lock, run.json, DCP's .metadata: < 64 KiB),
# below the debug model's checkpoint shard (about 2 MB).
FILE_SIZE_LIMIT = 256 * 1024


def _run(dump: Path, *overrides: str, preexec_fn=None, prefix: tuple[str, ...] = (),
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    args = ["--job.dump_folder", str(dump), "--metrics.log_freq", "1000", *overrides]
    return subprocess.run([*prefix, *training_command(CONFIG, args)], cwd=REPO, capture_output=True, text=True,
                          env=run_env(env), preexec_fn=preexec_fn, timeout=300)


def _limit_file_size() -> None:
    """In the child: a real filesystem limit. A write past it fails with EFBIG (SIGXFSZ ignored), as a
    write to a full disk fails with ENOSPC."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))


def test_disk_full_says_so_keeps_checkpoints_and_resumes_exactly(tmp_path: Path) -> None:
    reference, dump = tmp_path / "reference", tmp_path / "run"
    together(lambda: train(reference, "--training.steps", "6", *COMMON),
             lambda: train(dump, "--training.steps", "4", *COMMON))

    started = time.monotonic()
    full = _run(dump, "--training.steps", "6", *COMMON, preexec_fn=_limit_file_size)
    elapsed = time.monotonic() - started
    line = assert_refused(full, f"saving step 6 into {dump / 'checkpoint'} failed: the disk is full",
                          "complete checkpoints there are kept")
    assert "unexpected pos" not in line
    assert elapsed < 60, f"the failed run took {elapsed:.0f} s to exit"
    assert complete_steps(dump / "checkpoint") == [2, 4]  # step-6 stays a .partial: never picked
    assert all(verify_integrity(dump / "checkpoint" / f"step-{step}") for step in (2, 4))

    resumed = train(dump, "--training.steps", "6", *COMMON)  # space is back
    assert f"resumed from {dump / 'checkpoint' / 'step-4'}" in resumed.stdout
    assert complete_steps(dump / "checkpoint") == [2, 4, 6]
    assert_every_line_matches(reference, dump)  # steps 5-6 logged twice, each bit for bit the reference's
    # Control: the comparison catches a run that is not the reference.
    other = tmp_path / "other_seed"
    train(other, "--training.steps", "6", *COMMON, "--debug.seed", "1")
    with pytest.raises(AssertionError, match="step 1:"):
        assert_every_line_matches(reference, other)


def test_dump_folder_that_is_a_file(tmp_path: Path) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("mine\n")
    assert_refused(_run(file, "--training.steps", "2"), f"job.dump_folder = '{file}' is a file, not a folder")
    assert_refused(_run(file / "run", "--training.steps", "2"), f"is inside {file}, which is a file")
    assert file.read_text() == "mine\n"


def test_dump_folder_not_writable(tmp_path: Path) -> None:
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    # root writes anywhere; without the capability to override permissions it is refused like anyone else.
    prefix = ("setpriv", "--bounding-set=-dac_override,-dac_read_search", "--") if os.geteuid() == 0 else ()
    try:
        for dump in (folder, folder / "run"):
            assert_refused(_run(dump, "--training.steps", "2", prefix=prefix),
                           f"{folder} is not writable", "pass --job.dump_folder")
    finally:
        folder.chmod(0o755)
    assert list(folder.iterdir()) == []


ITERABLE_SPEC = '''
import torch
from torch.utils.data import IterableDataset
from my_pkg import my_spec
from torchtitan_rng import TrainSpec, register_train_spec


class Stream(IterableDataset):
    def __iter__(self):
        while True:
            yield {"x": torch.zeros(1), "y": torch.zeros(1)}


register_train_spec(TrainSpec(name="stream_sine", build_model=my_spec.build_model,
                              build_dataset=lambda config: Stream(), loss_fn=my_spec.loss_fn,
                              apply_fsdp=my_spec.apply_fsdp, items_per_sample=lambda config: 1,
                              throughput_unit="samples"))
'''


def test_train_spec_with_an_iterable_dataset(tmp_path: Path) -> None:
    (tmp_path / "stream_spec.py").write_text(ITERABLE_SPEC)
    path = os.pathsep.join([str(tmp_path), str(REPO / "examples" / "plugin"), os.environ.get("PYTHONPATH", "")])
    proc = _run(tmp_path / "run", "--job.custom_module", "stream_spec", "--model.name", "stream_sine", "--model.flavor", "small",
                "--training.steps", "2", env={"PYTHONPATH": path})
    assert_refused(proc, "model 'stream_sine' (build_dataset of its TrainSpec): the dataset is an IterableDataset "
                         "(Stream)", "index your data in a torch.utils.data.Dataset")
