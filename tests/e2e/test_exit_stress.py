"""A finished two-process run exits 0, every time: the failing shape of a rare abort at exit ("terminate
called without an active exception" on rank 0 after the checkpoint was saved), repeated a few times side by
side. A gloo worker of a process group that outlived the teardown released a collective's Python tensor after
interpreter finalization began (trainer.Trainer._release, train.exit_now). The long version, hundreds of runs
under load: ``python -m bench.exit_stress``."""

from __future__ import annotations

from pathlib import Path

from tests.support.launch import together, train

RUNS = 4


def test_two_process_runs_exit_zero(tmp_path: Path) -> None:
    folders = [tmp_path / f"run-{index}" for index in range(RUNS)]

    def runs(share: list[Path]) -> list[int]:  # train() raises with the run's output when it exits non-zero
        return [train(folder, "--training.steps", "2", "--lr_scheduler.total_steps", "6", "--checkpoint.enable",
                      "--checkpoint.interval", "2", "--validation.enable", "false",
                      "--training.mixed_precision_param", "bfloat16", nproc=2).returncode
                for folder in share]

    codes = [code for share in together(lambda: runs(folders[::2]), lambda: runs(folders[1::2])) for code in share]
    assert codes == [0] * RUNS
    assert all((folder / "checkpoint" / "step-2").is_dir() for folder in folders)
