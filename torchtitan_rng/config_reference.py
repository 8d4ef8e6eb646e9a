"""docs/config.md, generated from the config schema (each key's type, default, valid values and meaning are
declared with the key in config.py).

``python -m torchtitan_rng.config_reference`` rewrites docs/config.md; ``--check`` exits 1 when the page
differs from what it would write (a test runs the same comparison).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torchtitan_rng.config import KeyInfo, describe_keys

DEFAULT_PAGE = Path("docs") / "config.md"

_PREAMBLE = """\
# Config reference

Generated from the config schema (`torchtitan_rng/config.py`) by `python -m torchtitan_rng.config_reference`;
a test fails when this page and the schema differ. `python -m torchtitan_rng.train --help` prints the same.

A run's values come from the defaults below, then the TOML file named by `--job.config_file` (one
`[section]` table per section below), then the command line, last wins:

```bash
python -m torchtitan_rng.train --job.config_file F [--section.key value | --section.key=value | --flag]
./run_train.sh [--section.key value ...]          # the same overrides, CONFIG_FILE names the TOML file
```

A bare `--section.key` sets a true/false key to true; a list is comma-separated on the command line
(`--checkpoint.allow_config_change optimizer.lr,lr_scheduler.total_steps`) and a TOML array in a file. An
unknown section or key, a wrong type, a value out of range or a number that is not finite (`nan`, `inf`,
`1e400`) prints one line naming it (and the valid values) and exits 2; `run_train.sh` checks this before it starts any process. Which keys may change
between a stop and its resume: [changes.md](changes.md).
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _values(key: KeyInfo) -> str:
    if key.choices:
        return ", ".join(f"`{choice}`" for choice in key.choices)
    return f">= {key.minimum:g}" if key.minimum is not None else ""


def render() -> str:
    """The whole page, from the schema."""
    lines = [_PREAMBLE]
    section = ""
    for key in describe_keys():
        name = key.dotted.split(".")[0]
        if name != section:
            section = name
            lines += ["", f"## [{section}]", "", "| key | type | default | values | meaning |",
                      "| --- | --- | --- | --- | --- |"]
        lines.append(f"| `{key.dotted}` | {key.type_name} | `{json.dumps(key.default)}` | {_values(key)} | "
                     f"{_cell(key.meaning)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtitan_rng.config_reference",
                                     description="Write the config reference page from the schema.")
    parser.add_argument("page", nargs="?", type=Path, default=DEFAULT_PAGE, help=f"default: {DEFAULT_PAGE}")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when the page is stale")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        current = args.page.read_text() if args.page.is_file() else None
        if current != page:
            print(f"{args.page} differs from the config schema; run python -m torchtitan_rng.config_reference",
                  file=sys.stderr)
            return 1
        return 0
    args.page.parent.mkdir(parents=True, exist_ok=True)
    args.page.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
