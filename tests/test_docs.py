"""The README and docs/: the commands a new user copies are there as CI runs them, and every
relative link (files, images, #anchors) leads somewhere, so that moving text between pages cannot
leave a dead link behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SETUP = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]'"
TESTS = ".venv/bin/python -m pytest -q"
QUICK_JOB = (
    ".venv/bin/python -m fedjax_split.train --config configs/offline_rotten_tomatoes.py "
    "--max-examples 2000 --rounds 3 --output-dir runs/rt_quick"
)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_readme_has_the_setup_test_and_quick_job_commands_ci_runs() -> None:
    text = README.read_text()
    for command in (SETUP, TESTS, QUICK_JOB):
        assert command in text, command
    assert text.index(QUICK_JOB) < text.index("--task=sst2"), "the first run needs no hub"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "-m venv" in ci and "pip\" install -e '.[test]'" in ci
    assert '/bin/python" -m pytest -q' in ci, "CI runs the README's test command"


def test_the_readme_starts_short() -> None:
    """What a new user reads before the links to docs/ stays a few minutes' read."""
    head = README.read_text().split("\n## Documentation\n")[0]
    assert len(head.split()) <= 1200


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_anchor(page: Path) -> None:
    dead = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            dead.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            dead.append(target)
    assert not dead, f"dead links in {page.name}: {dead}"


def test_the_link_check_can_fail(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# A title\n[ok](#a-title) [gone](missing.md) [no](#nowhere) [w](https://x.y)\n")
    assert _links(page) == ["#a-title", "missing.md", "#nowhere"]
    assert _anchors(page) == {"a-title"}
