"""Exit stress: many short two-process runs (launcher, bf16 FSDP policy, checkpoint saved), counting the ones
that exit non-zero although they trained — the "terminate called without an active exception" abort at
interpreter exit (docs/design.md, "Tear down cleanly") is rare and more frequent under CPU load.

    python -m bench.exit_stress [--runs 300] [--parallel 2] [--hog 1] [--steps 3] [--keep FOLDER]

``--hog N`` adds N busy-looping processes for the whole bench (load makes the abort likelier). Each failed
run's output is kept under ``--keep`` (default: a temporary folder, printed). Exit status 1 if any run failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "train_configs" / "llama_debug.toml"


def command(dump: Path, steps: int) -> list[str]:
    from torchtitan_rng.launch.runs import training_command

    return training_command(CONFIG, [
        "--job.dump_folder", str(dump), "--metrics.log_freq", "1000", "--training.steps", str(steps),
        "--lr_scheduler.total_steps", "6", "--checkpoint.enable", "--checkpoint.interval", "2",
        "--validation.enable", "false", "--training.mixed_precision_param", "bfloat16"], nproc=2)


def one_run(index: int, scratch: Path, steps: int) -> tuple[int, int, str]:
    """(index, exit status, output) of one run into a fresh folder, removed when it exited 0."""
    dump = scratch / f"run-{index}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))}
    proc = subprocess.run(command(dump, steps), cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode == 0:
        subprocess.run(["rm", "-rf", str(dump)], check=False)
    return index, proc.returncode, proc.stdout + proc.stderr


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--runs", type=int, default=300)
    args.add_argument("--parallel", type=int, default=2, help="runs side by side (default 2)")
    args.add_argument("--hog", type=int, default=1, help="busy-looping processes beside the runs (default 1)")
    args.add_argument("--steps", type=int, default=3)
    args.add_argument("--keep", type=Path, default=None, help="folder for the runs (kept for failed ones)")
    opts = args.parse_args()
    scratch = opts.keep or Path(tempfile.mkdtemp(prefix="exit_stress-"))
    scratch.mkdir(parents=True, exist_ok=True)
    # A hog spins while its parent lives: a bench killed by a signal leaves none behind.
    hog = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"
    hogs = [subprocess.Popen([sys.executable, "-c", hog]) for _ in range(opts.hog)]
    failed: list[tuple[int, int]] = []
    start = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=opts.parallel) as pool:
            for done, (index, code, output) in enumerate(
                    pool.map(lambda i: one_run(i, scratch, opts.steps), range(opts.runs)), 1):
                if code != 0:
                    failed.append((index, code))
                    (scratch / f"run-{index}.log").write_text(output)
                    tail = "\n  ".join(output.strip().splitlines()[-4:])
                    print(f"run {index}: exit {code}\n  {tail}", flush=True)
                if done % 25 == 0:
                    print(f"{done}/{opts.runs} runs, {len(failed)} failed, {time.monotonic() - start:.0f} s",
                          flush=True)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print(f"exit-stress: {len(failed)} of {opts.runs} two-process runs exited non-zero "
          f"({opts.parallel} side by side, {opts.hog} hog(s), {time.monotonic() - start:.0f} s); folder {scratch}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
