"""The README and docs/ hold together: links resolve, the README stays a front door.

- every relative Markdown link in README.md and docs/*.md names a file of the
  repository, and a ``#fragment`` names a heading of the page it points at;
- README.md is at most ``README_MAX_LINES`` lines;
- no source or page cites the design brief by section number (it is not in
  the repository; docs/design.md is);
- code blocks marked ``# docs-test: NAME`` (run verbatim by the docs' own
  tests) are named once each and at least parse.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Folders of build outputs, runs and models: not the repository's text.
_SKIP_DIRS = {"__pycache__", "build", "runs", "models", "bench-out"}

_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)
_DOCS_TEST = re.compile(r"^```(\w+)\n# docs-test: (\S+)\n(.*?)^```", re.M | re.S)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in _HEADING.findall(_FENCE.sub("", page.read_text()))}


def _links(page: Path) -> list[str]:
    return _LINK.findall(_FENCE.sub("", page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.name}")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move the detail to docs/"
    )


def _sources() -> list[Path]:
    """The repository's .py, .md and .yaml files (no venvs, caches or outputs)."""
    out = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS]
        out += [Path(top, f) for f in files if f.endswith((".py", ".md", ".yaml"))]
    return out


def test_nothing_cites_the_design_brief_by_section() -> None:
    # Spelt apart so that this file does not match itself.
    cite = re.compile("DESIGN" + r"(?:'s\b|\s+section)")
    hits = []
    for path in _sources():
        text = path.read_text(errors="replace")
        hits += [
            f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            for m in cite.finditer(text)
        ]
    assert not hits, f"cite docs/design.md, or say the thing itself: {hits}"


def test_no_page_dates_its_figures_by_distance() -> None:
    stale = re.compile(r"commits earlier|earlier commit of this change|as of an earlier commit")
    hits = [p.name for p in PAGES if stale.search(p.read_text())]
    assert not hits, f"a figure names its commit, not a distance: {hits}"


def _docs_tests() -> list[tuple[str, str, str, str]]:
    return [(p.name, *m.groups()) for p in PAGES for m in _DOCS_TEST.finditer(p.read_text())]


def test_docs_test_blocks_are_named_once_and_parse() -> None:
    blocks = _docs_tests()
    names = [name for _, _, name, _ in blocks]
    assert {"model", "serve", "client"} <= set(names), names
    assert len(names) == len(set(names)), names
    for page, lang, name, code in blocks:
        if lang == "python":
            compile(code, f"{page}:{name}", "exec")
        elif lang == "bash" and shutil.which("bash"):
            got = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True)
            assert got.returncode == 0, (page, name, got.stderr)
        else:
            assert lang in ("bash", "sh", "python"), (page, name, lang)
