"""Every repository file the docs and the code's comments name exists.

Checked: README.md and docs/*.md (all of their text), and the comments and
docstrings of the project's .py files (the top-level folders and
examples/). Not checked: other string literals, which are data.

What counts as a named file:

- a relative path under a top-level folder with a file ending, such as
  ``tests/coordinator/test_two_level.py``, ``benchmarks/compile.py`` or
  ``configs/local.yaml``; a ``:LINE``, ``::test_name`` or ``#anchor`` after
  it is not part of it. Paths with a glob or a placeholder in them (``*``,
  ``<``, ``{``, ``...``, or a component such as ``NAME``) are skipped.
- a dotted module name ``gramcoord.PKG.MOD...`` whose ``PKG`` is one of the
  installed folders. The longest prefix that is a module is resolved; the
  rest may be attributes (``gramcoord.sync.ring.BitmaskRing``). A name is
  reported only where that prefix is a package and the next component is
  neither a module, nor a subpackage, nor a name in the package's
  ``__init__.py``. A capitalised component is an attribute, and
  ``gramcoord.grammar.compile_timeout_s``, whose ``PKG`` is no folder, is a
  config path: neither is checked.

Pure file reading: no git, no subprocess, no import of the project.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Top-level folders a named path may start with.
FOLDERS = (
    "coordinator",
    "rank_worker",
    "sync",
    "launch",
    "engine",
    "integrations",
    "benchmarks",
    "tests",
    "configs",
    "docs",
    "examples",
)
# Folders whose .py files are scanned for comments and docstrings.
PY_FOLDERS = FOLDERS
# gramcoord.PKG -> its folder (pyproject.toml's package-dir).
PACKAGES = {
    "coordinator": "coordinator",
    "rank_worker": "rank_worker",
    "sync": "sync",
    "launch": "launch",
    "engine": "engine",
    "integrations": "integrations",
    "benchmarks": "benchmarks",
    "configs": "configs",
    "dev_data": "tests/data",
}
EXTENSIONS = frozenset(
    {"py", "md", "yaml", "yml", "json", "jsonl", "txt", "toml", "gz", "cfg", "ini", "sh", "svg"}
    | {"png", "csv", "pyi"}
)
# Path components that stand for a name, not one.
PLACEHOLDERS = frozenset(
    {"NAME", "DIR", "FILE", "PATH", "OUT", "MODEL", "CONFIG", "WORKLOAD", "SCHEMAS", "X", "N"}
)
SKIP_DIRS = frozenset({"__pycache__", "build", "runs", "models", "bench-out"})

_PATH = re.compile(r"(?<![\w./-])(?:" + "|".join(FOLDERS) + r")/[^\s`'\"()\[\],;|]*")
_FILE = re.compile(r"[\w./-]+\.([A-Za-z0-9]+)")
_DOTTED = re.compile(r"(?<![\w.])gramcoord(?:\.[A-Za-z_]\w*)+")


def _paths_in(text: str) -> Iterator[str]:
    """The repository file paths named in ``text``."""
    for m in _PATH.finditer(text):
        token = m.group(0)
        if any(mark in token for mark in ("*", "<", "{", "...")):
            continue
        token = re.split(r"[:#]", token, maxsplit=1)[0].rstrip(".>")
        got = _FILE.fullmatch(token)
        if not got or got.group(1) not in EXTENSIONS:
            continue  # a folder, or a dotted attribute after a path
        if PLACEHOLDERS.intersection(re.findall(r"[A-Za-z]+", token)):
            continue  # configs/NAME.yaml, benchmarks/NAME_bench.py
        yield token


def _exported(package: list[str], name: str) -> bool:
    init = ROOT.joinpath(*package, "__init__.py")
    return init.is_file() and re.search(rf"\b{re.escape(name)}\b", init.read_text()) is not None


def _resolves(package: list[str], rest: list[str]) -> bool:
    """Whether ``rest`` under the folder ``package`` is a module, a subpackage
    or a name the package exports, followed by anything (attributes)."""
    for mod in rest:
        if mod[:1].isupper():
            return True  # an attribute: gramcoord.sync.BitmaskChannel
        if ROOT.joinpath(*package, mod).with_suffix(".py").is_file():
            return True  # a module: the rest are its attributes
        if ROOT.joinpath(*package, mod).is_dir():
            package = [*package, mod]  # a subpackage: look one further
            continue
        return _exported(package, mod)
    return True


def _dotted_in(text: str) -> Iterator[str]:
    """The ``gramcoord.PKG.MOD...`` names in ``text`` that resolve to no file."""
    for m in _DOTTED.finditer(text):
        name = m.group(0)
        parts = name.split(".")[1:]
        folder = PACKAGES.get(parts[0])
        if folder is None:
            continue  # a config path (gramcoord.grammar.x), not a module
        if not _resolves(folder.split("/"), parts[1:]):
            yield name


def _named(text: str) -> Iterator[str]:
    yield from _paths_in(text)
    yield from _dotted_in(text)


def _missing(name: str) -> bool:
    if name.startswith("gramcoord."):
        return True  # _dotted_in yields only names that resolve to nothing
    return not (ROOT / name).exists()


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _py_files() -> list[Path]:
    out = []
    for folder in PY_FOLDERS:
        for top, dirs, files in os.walk(ROOT / folder):
            dirs[:] = sorted(
                d
                for d in dirs
                if not d.startswith(".") and d not in SKIP_DIRS and not d.endswith(".egg-info")
            )
            out += [Path(top, f) for f in sorted(files) if f.endswith(".py")]
    return out


def _commented_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every comment and docstring line of ``path``."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if not isinstance(node, nodes) or not node.body:
            continue
        first = node.body[0]
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            for number in range(first.lineno, (first.end_lineno or first.lineno) + 1):
                yield number, lines[number - 1]


def _report(hits: list[str], where: str) -> str:
    return f"{len(hits)} missing file(s) named in {where}:\n" + "\n".join(hits)


def test_pages_name_only_files_that_exist() -> None:
    hits = []
    for page in _pages():
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            hits += [
                f"{page.relative_to(ROOT)}:{number}: {name}"
                for name in _named(line)
                if _missing(name)
            ]
    assert not hits, _report(hits, "README.md and docs/")


def test_comments_and_docstrings_name_only_files_that_exist() -> None:
    hits = []
    for path in _py_files():
        for number, line in sorted(set(_commented_lines(path))):
            hits += [
                f"{path.relative_to(ROOT)}:{number}: {name}"
                for name in _named(line)
                if _missing(name)
            ]
    assert not hits, _report(hits, "comments and docstrings")


def test_the_path_finder_reads_paths_as_documented() -> None:
    text = (
        "see `tests/coordinator/test_two_level.py::test_x`, benchmarks/compile.py:12, "
        "[d](docs/design.md#grammars), configs/NAME.yaml, benchmarks/NAME_bench.py, tests/*/x.py, "
        "sync/ring.BitmaskRing, a/tests/nope.py, launch/ (a folder)."
    )
    assert list(_paths_in(text)) == [
        "tests/coordinator/test_two_level.py",
        "benchmarks/compile.py",
        "docs/design.md",
    ]
    dotted = (
        "gramcoord.sync.ring.BitmaskRing gramcoord.grammar.compile_timeout_s "
        "gramcoord.rank_worker.session gramcoord.sync.BitmaskChannel gramcoord.sync.nope "
        "gramcoord.rank_worker.masks.gate gramcoord.rank_worker.masks.nope.x"
    )
    assert list(_dotted_in(dotted)) == ["gramcoord.sync.nope", "gramcoord.rank_worker.masks.nope.x"]
