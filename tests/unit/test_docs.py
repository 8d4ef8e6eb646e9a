"""The README and docs/ pages: every link lands on a page and heading that exist, every repository path they
cite exists, and nothing refers to what a user does not have (internal work items)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.launch import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CITED_PATH = re.compile(r"`((?:torchtitan_rng|tests|bench|examples|train_configs|scripts|docs)/[\w./-]+)`")
# An extra installed from the clone without -e: a copy of the package that later edits of the clone do not reach
# (run_train.sh and run_tests.sh install it editable).
_COPY_INSTALL = re.compile(r"pip install (?!-e )[\"']?\.\[")
_INTERNAL = re.compile(r"\b(issue|work item|ticket) #?\d+|DEVELOPERS\.md|/work/", re.IGNORECASE)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _broken_links(page: Path) -> list[str]:
    broken = []
    for target in _LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    return broken


def test_every_link_lands() -> None:
    assert {page.name: _broken_links(page) for page in PAGES if _broken_links(page)} == {}


def test_a_broken_link_is_caught(tmp_path: Path) -> None:
    """Control: a missing page and a missing heading are both reported."""
    (tmp_path / "a.md").write_text("# A page\n\n## The part\n\n[ok](#the-part) [gone](b.md) [no](#other)\n")
    assert _broken_links(tmp_path / "a.md") == ["b.md", "#other"]


def test_every_cited_path_exists() -> None:
    missing = {page.name: [path for path in _CITED_PATH.findall(page.read_text()) if not (REPO / path).exists()]
               for page in PAGES}
    assert {name: paths for name, paths in missing.items() if paths} == {}


def test_nothing_refers_to_internal_documents() -> None:
    found = {page.name: _INTERNAL.findall(page.read_text()) for page in PAGES}
    assert {name: hits for name, hits in found.items() if hits} == {}
    # Control: the pattern catches such references (built here so that a grep of the repository stays clean).
    assert _INTERNAL.search("as measured for {} {}".format("issue", 7))
    assert _INTERNAL.search("see {}.md".format("DEVELOPERS"))


def test_extras_from_the_clone_install_editable() -> None:
    found = {page.name: _COPY_INSTALL.findall(page.read_text()) for page in PAGES}
    assert {name: hits for name, hits in found.items() if hits} == {}
    # Control: the pattern catches a copy install of an extra, and lets the editable one and a registry name by.
    assert _COPY_INSTALL.search('pip install ".[plot]"') and _COPY_INSTALL.search("pip install '.[hf]'")
    assert not _COPY_INSTALL.search('pip install -e ".[plot]"')
    assert not _COPY_INSTALL.search("pip install 'torchtitan_rng[s3]'")


def test_readme_is_a_front_door() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 250
