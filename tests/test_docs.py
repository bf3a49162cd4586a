"""The docs build's own check (docs/hooks.py): a list written right under a paragraph line, which
Python-Markdown renders as that paragraph's run-on text, fails `mkdocs build --strict`."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
hooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hooks)

RUN_ON = "Some text:\n- first\n- second\n"


@pytest.mark.parametrize("text, found", [
    (RUN_ON, [(2, "- first")]),
    ("Steps:\n1. one\n2. two\n", [(2, "1. one")]),
    ("Text\n* star\n", [(2, "* star")]),
    ("Some text:\n\n- first\n- second\n", []),  # the blank line
    ("# Title\n- first\n", []),  # a heading is a block of its own
    ("- item\n  its text, continued\n- next\n  - nested\n", []),  # inside one list
    ("- item\nlazy continuation\n- next\n", []),
    ("Text\n```yaml\n- not a list\n```\n", []),  # code
    ("Text\n~~~~\n```\n- still code\n~~~~\n", []),  # a fence closes with its own character
    ("- a list\n\nA paragraph after it:\n- run on\n", [(4, "- run on")]),  # the first list has ended
    ("Rate is -1 or 2. Then\nmore text\n", []),  # markers only at a line's start
])
def test_a_list_right_under_a_paragraph_line_is_found(text, found):
    assert hooks.lists_without_blank_line(text) == found


def test_the_site_pages_have_none():
    pages = sorted(DOCS.glob("*.md"))
    found = {p.name: hooks.lists_without_blank_line(p.read_text()) for p in pages}
    assert pages and found == {p.name: [] for p in pages}


def test_mkdocs_strict_fails_on_a_list_without_its_blank_line(tmp_path):
    """Through the build itself, as CI runs it (-q, which hides warnings from --strict): the
    hook's error fails it, naming the page and line."""
    pytest.importorskip("mkdocs")
    (tmp_path / "pages").mkdir()
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"site_name: t\ndocs_dir: pages\nhooks:\n  - {DOCS / 'hooks.py'}\n")

    def build(page: str) -> subprocess.CompletedProcess:
        (tmp_path / "pages" / "index.md").write_text(f"# Page\n\n{page}")
        return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(config),
                               "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=120)

    failed = build(RUN_ON)
    assert failed.returncode != 0 and "index.md:4: a list right under a paragraph line" in failed.stderr, failed.stderr
    built = build(RUN_ON.replace(":\n", ":\n\n"))
    assert built.returncode == 0, built.stderr
