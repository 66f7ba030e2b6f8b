"""The project's Markdown holds together: every relative link resolves to a file of the
repository, and no doc (nor a benchmark's docstring, which is its documentation) names a
path of one development machine, which no user has."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.S)
MACHINE_PATH = re.compile(r"(?<![\w.~])(/work/|/home/\w+|/root/|/Users/\w+|\S*\.venv/bin/)")
"""Paths of a development machine: its home or work directories, a virtual environment."""


def tracked(pattern: str) -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", pattern], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in out]


def links(text: str) -> list[str]:
    """Relative link targets outside code blocks (a URL or an in-page anchor is not one)."""
    return [t for t in LINK.findall(FENCE.sub("", text))
            if not re.match(r"[a-zA-Z][\w+.-]*:", t) and not t.startswith("#")]


def test_the_link_finder_finds_what_it_should():
    text = "see [a](docs/x.md#y), [b](https://e.org) and [c](#here)\n```\n[d](no.md)\n```"
    assert links(text) == ["docs/x.md#y"]
    assert MACHINE_PATH.search("python /work/main/.venv/bin/python x")
    assert MACHINE_PATH.search("source .venv/bin/activate")
    assert not MACHINE_PATH.search("pip install -e '.[dev]' && accelopt run --dir /tmp/x")


def test_every_relative_link_in_every_markdown_file_resolves():
    broken = []
    for doc in tracked("*.md"):
        for target in links(doc.read_text(encoding="utf-8")):
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            if not path.exists() or ROOT not in (path, *path.parents):
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_no_doc_names_a_path_of_a_development_machine():
    found = []
    for doc in [*tracked("*.md"), *tracked("benchmarks/*.py"), *tracked("examples/*.py")]:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{doc.relative_to(ROOT)}:{number}: {line.strip()[:80]}")
    assert not found, found
