"""The commands of a docs page, run as a user copies them: the ```bash block after a heading (or a line of the
page), run by bash in a folder laid out as the repository, so that ``./run_train.sh``, ``examples/...`` and
relative outputs mean what the page says, with ``python`` and ``run_train.sh``'s interpreter this one (and, for a
block run warm, ``torchrun`` this one's torchrun)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.launch import REPO, launch, run_env

_NOT_LINKED = {".git", ".venv", "outputs"}


def block_after(page: str, marker: str) -> str:
    """The first ```bash block after ``marker`` (a heading or any text) in docs/``page``."""
    text = (REPO / "docs" / page).read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index(marker):], re.S)
    assert block is not None, f"no bash block after {marker!r} in {page}"
    return block.group(1)


def as_repository(folder: Path) -> Path:
    """``folder`` (made) with every top-level entry of the repository linked into it."""
    folder.mkdir(parents=True)
    for entry in REPO.iterdir():
        if entry.name not in _NOT_LINKED:
            (folder / entry.name).symlink_to(entry)
    return folder


def run_block(block: str, folder: Path, processes: int = 1, *, env: dict[str, str] | None = None,
              warm: tuple[str, ...] | None = None) -> subprocess.CompletedProcess:
    """``block`` as one bash script (stopping at the first command that fails) in ``folder``, with ``env`` added
    to the processes' environment. ``warm``: the block's ``python`` and ``torchrun`` commands fork from a warm
    server that has imported these modules too (tests/support/zygote.py), as the tests' own launches do."""
    first = Path(sys.executable).parent
    if warm is not None:
        first = _warm_commands(folder.parent / f"{folder.name}.bin")
    variables = run_env({"PATH": f"{first}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable, **(env or {})})
    return launch(["bash", "-e", "-c", block], env=variables, cwd=folder, processes=processes, preload=warm or ())


def _warm_commands(folder: Path) -> Path:
    """``python`` and ``torchrun`` that run ``$PYTHON``, the relay to the warm server that ``launch`` gives the
    block (the same interpreter): torchrun is that interpreter's ``-m torch.distributed.run``, as torch's own
    ``torchrun`` script is."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, args in (("python", '"$@"'), ("torchrun", '-m torch.distributed.run "$@"')):
        (folder / name).write_text(f'#!/bin/sh\nexec "$PYTHON" {args}\n')
        (folder / name).chmod(0o755)
    return folder
