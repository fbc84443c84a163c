"""``gramcoord bench``: discovery from the package, the data an install finds, the report.

The cheap side: no benchmark runs here (``test_all.py`` runs one).
"""

from __future__ import annotations

import ast
import json
import re
import textwrap
from pathlib import Path

import msgspec
import pytest

from gramcoord.benchmarks import _contract as bench_mod
from gramcoord.benchmarks._all import (
    PAGE_BEGIN,
    PAGE_END,
    PLANS,
    BenchMeta,
    BenchRun,
    _parse,
    _selection,
    code_commit,
    markdown,
)
from gramcoord.benchmarks._contract import (
    BenchRecord,
    available,
    format_table,
    installed_data_dir,
    interleaved_ms,
    load,
    run_bench,
)
from gramcoord.launch.cli import main

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = {"agreement", "compile", "fill", "step", "transport"}


@pytest.fixture
def fake_pkg(tmp_path, monkeypatch):
    """A namespace package of benchmarks: two real ones, a helper, a private one."""
    pkg = tmp_path / "fakebench"
    pkg.mkdir()
    files = {
        "ok.py": """
            from gramcoord.benchmarks._contract import BenchRecord

            def run(args):
                n = int(args[0]) if args else 1
                return [BenchRecord.compare("thing", "other", 1.0, 2.0 * n, target=1.5)]
            """,
        # Listing must not import it: it would raise.
        "boom.py": """
            raise RuntimeError("imported")

            def run(args):
                return []
            """,
        "helper.py": "def not_run():\n    return 1\n",
        "_private.py": "def run(args):\n    return []\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fakebench"


def test_available_lists_the_packaged_benchmarks_and_skips_helpers():
    names = available()
    assert set(names) >= SHIPPED, names
    assert "all" not in names
    # Helpers: a leading underscore (a module without run(): fake_pkg below).
    assert not [n for n in names if n.startswith("_")]
    for name in names:  # NAME.py, or NAME_bench.py where NAME would shadow a package
        files = [ROOT / "benchmarks" / f"{m}.py" for m in (name, f"{name}_bench")]
        assert any(f.is_file() for f in files), name


def test_available_reads_sources_without_importing(fake_pkg):
    assert available(fake_pkg) == ["boom", "ok"]


def test_load_refuses_an_unknown_name_and_lists_the_known_ones(fake_pkg):
    with pytest.raises(SystemExit, match=r"unknown benchmark 'nope'; available: boom, ok, all"):
        load("nope", fake_pkg)
    with pytest.raises(SystemExit, match="helper"):
        load("helper", fake_pkg)


def test_run_bench_names_its_benchmark_on_every_record(fake_pkg, tmp_path, capsys):
    records = run_bench("ok", ["3"], tmp_path / "out", package=fake_pkg)
    assert [(r.bench, r.ratio, r.met) for r in records] == [("ok", 6.0, True)]
    written = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert written[0]["bench"] == "ok" and written[0]["error"] is None
    assert "thing" in capsys.readouterr().out


def test_benchmarks_import_each_other_through_the_package():
    """An installed package has no top-level ``benchmarks``: every import,
    and every spawn target ("module:function"), must go through ``gramcoord``."""
    bad = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
                "benchmarks",
                "launch",
            ):
                bad.append(f"{path.name}:{node.lineno} from {node.module}")
            elif isinstance(node, ast.Import):
                bad += [
                    f"{path.name}:{node.lineno} import {a.name}"
                    for a in node.names
                    if a.name.split(".")[0] == "benchmarks"
                ]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"benchmarks\.\w+:[\w.]+", node.value):
                    bad.append(f"{path.name}:{node.lineno} spawn target {node.value!r}")
            elif isinstance(node, ast.Attribute) and ast.unparse(node) in (
                "sys.path.insert",
                "sys.path.append",
            ):
                bad.append(f"{path.name}:{node.lineno} edits sys.path")
    assert bad == []


# -- data an installed package finds ---------------------------------------------


def test_a_checkout_keeps_its_own_data(monkeypatch):
    monkeypatch.delenv("GRAMCOORD_DATA_DIR", raising=False)
    assert installed_data_dir() is None
    monkeypatch.setenv("GRAMCOORD_DATA_DIR", "/nonexistent")
    assert installed_data_dir() is None


def test_without_checkout_data_the_installed_subset_is_the_default(monkeypatch, tmp_path):
    monkeypatch.delenv("GRAMCOORD_DATA_DIR", raising=False)
    monkeypatch.setattr(bench_mod, "dev_data_dir", lambda: tmp_path)
    found = installed_data_dir()
    # In this editable install, gramcoord.dev_data is tests/data itself.
    assert found is not None and found.resolve() == (ROOT / "tests" / "data").resolve()
    assert (found / "schemas-dev.xgrammar-labels.jsonl").is_file()
    assert (found / "LICENSES").is_dir()


# -- bench all's choices, without running anything ---------------------------------


def test_every_shipped_benchmark_has_a_plan():
    assert set(PLANS) >= SHIPPED
    assert set(PLANS) <= set(available()), "a plan for a benchmark that is gone"
    assert all(p.timeout_s > 0 for p in PLANS.values())


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        pytest.param(["--only", "transport"], {"transport": []}, id="full-plan"),
        pytest.param(
            ["--only", "transport", "--quick"],
            {"transport": list(PLANS["transport"].quick)},
            id="quick-plan",
        ),
        pytest.param(
            ["--only", "compile,transport", "--args", "transport=--iters 5 --rows 8"],
            {"compile": list(PLANS["compile"].args), "transport": ["--iters", "5", "--rows", "8"]},
            id="args-replace-a-plan",
        ),
    ],
)
def test_selection(argv, want):
    assert _selection(_parse(argv)) == want


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--only", "nope"], "unknown benchmark", id="unknown-only"),
        pytest.param(["--args", "nope=--x 1"], "unknown benchmark", id="unknown-args"),
        pytest.param(["--args", "transport"], "expected NAME=ARGS", id="args-without-equals"),
    ],
)
def test_selection_refuses_bad_input(argv, message):
    with pytest.raises(SystemExit, match=message):
        _selection(_parse(argv))


# -- the report --------------------------------------------------------------------


def _records() -> list[BenchRecord]:
    rows = [
        BenchRecord.compare("fast", "slow", 1.0, 4.0, target=3.0, note="a | b"),
        BenchRecord.compare("miss", "slow", 1.0, 2.0, target=3.0),
        BenchRecord.compare("timed", "cold", 0.2, 30.0, target_ms=0.5),
        BenchRecord.compare("report", "other", 1.0, 1.1),
    ]
    for r in rows:
        r.bench = "demo"
    return [*rows, BenchRecord.failed("broken", "exit 1: ValueError: nope")]


def test_markdown_marks_missed_targets_and_failed_benchmarks():
    runs = [
        BenchRun(name="demo", args=["--n", "1"], wall_s=3.2, exit_code=0, num_records=4),
        BenchRun(name="broken", args=[], wall_s=0.5, exit_code=1, error="exit 1: ValueError"),
    ]
    md = markdown(_records(), runs)
    header = (
        "| benchmark | record | baseline | ours ms | baseline ms | ratio | target | met | note |"
    )
    targets, rest = md.split("**Runs**")
    runs_part, all_part = rest.split("**All records**")
    assert "2 met, 1 missed (**NO**), 1 benchmarks failed (**ERROR**)" in targets
    # The page's first table: rows with a target, and the failure; the report-only
    # row is only in the full table.
    rows = [ln for ln in targets.splitlines() if ln.startswith("| ") and ln != header]
    assert [ln.split(" | ")[1] for ln in rows] == ["fast", "miss", "timed", "-"]
    assert "| report |" not in targets and "| report |" in all_part
    assert rows[1].count("**NO**") == 1
    assert "| >= 3x | yes | a \\| b |" in rows[0]  # a pipe in a note stays in its cell
    assert "<= 0.5 ms" in rows[2]
    assert "**ERROR**" in rows[3] and "ValueError: nope" in rows[3]
    # Every row has as many cells as the header.
    cells = len(header.split(" | "))
    assert all(len(re.split(r"(?<!\\) \| ", ln)) == cells for ln in rows)
    assert "| demo | `--n 1` | 3.2 | 4 records |" in runs_part


def test_interleaved_ms_alternates_short_rounds_of_every_function():
    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    times = interleaved_ms(fns, repeat=15)
    assert set(times) == {"a", "b"} and min(times.values()) >= 0
    # max(3, 15 // 5) rounds; each a warm-up call and 5 timed calls per function.
    assert calls == (["a"] * 6 + ["b"] * 6) * 3


def test_render_puts_an_earlier_runs_tables_into_the_page(tmp_path, capsys):
    """``bench all --render --page``: no benchmark runs; the page's block is replaced."""
    out = tmp_path / "out"
    out.mkdir()
    runs = [BenchRun(name="demo", args=[], wall_s=3.2, exit_code=0, num_records=4)]
    meta = BenchMeta(
        command="gramcoord bench all --out bench-out", commit="0123456789ab", cpus=2, load_avg=0.5
    )
    for name, value in (("bench.json", _records()), ("bench_runs.json", runs)):
        (out / name).write_bytes(msgspec.json.encode(value))
    page = tmp_path / "performance.md"
    page.write_text(f"# Performance\n\nbefore\n\n{PAGE_BEGIN}\nstale tables\n{PAGE_END}\n\nafter\n")
    argv = ["bench", "all", "--out", str(out), "--render", "--page", str(page)]
    assert main(argv) == 2  # no bench_meta.json yet
    assert "no complete earlier run" in capsys.readouterr().err
    (out / "bench_meta.json").write_bytes(msgspec.json.encode(meta))
    assert main(argv) == 0
    text = page.read_text()
    assert text.startswith("# Performance\n\nbefore\n\n") and text.endswith(
        f"{PAGE_END}\n\nafter\n"
    )
    assert "stale tables" not in text and text.count(PAGE_BEGIN) == 1
    block = text.split(PAGE_BEGIN)[1]
    assert "`gramcoord bench all --out bench-out` at commit `0123456789ab`" in block
    assert markdown(_records(), runs).rstrip() in block
    assert (out / "bench.md").read_text() == markdown(_records(), runs)
    # A page without the markers is refused, and left as it was.
    page.write_text("# Performance\n")
    with pytest.raises(SystemExit, match="no block between"):
        main(argv)
    assert page.read_text() == "# Performance\n"


def test_the_commit_names_the_code_that_ran():
    commit = code_commit()
    assert re.fullmatch(r"[0-9a-f]{12}(-dirty)?", commit) or commit.startswith("unknown"), commit


def test_format_table_shows_an_error_row():
    text = format_table(_records()[-1:])
    assert "broken: ERROR" in text and "ValueError" in text


# -- the command line --------------------------------------------------------------


def test_bench_without_a_name_lists_the_benchmarks(capsys):
    assert main(["bench"]) == 2
    out = capsys.readouterr().out
    assert "transport" in out and out.rstrip().endswith(", all")


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        pytest.param(["bench", "all", "--help"], "--quick", id="all"),
        pytest.param(["bench", "transport", "--help"], "--iters", id="a-benchmark"),
    ],
)
def test_bench_help_is_the_named_benchmarks_own(argv, want, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    assert want in capsys.readouterr().out


def test_a_terminated_benchmark_runs_its_cleanup(tmp_path):
    """``bench all``'s deadline sends SIGTERM: the benchmark's ``finally`` blocks still
    run (they stop servers started in sessions of their own), and the run exits 143."""
    import signal
    import subprocess
    import sys
    import time

    pkg = tmp_path / "termbench"
    pkg.mkdir()
    (pkg / "slow.py").write_text(
        textwrap.dedent(
            f"""
            import time
            from pathlib import Path

            def run(args):
                try:
                    # Inside the try: the file exists once opened, so the
                    # signal can land before write_text returns.
                    Path({str(tmp_path / "started")!r}).write_text("")
                    time.sleep(120)
                finally:
                    Path({str(tmp_path / "cleaned")!r}).write_text("")
                return []
            """
        )
    )
    code = (
        "import sys; from pathlib import Path; "
        "from gramcoord.benchmarks._contract import run_bench; "
        f"run_bench('slow', [], Path({str(tmp_path / 'out')!r}), package='termbench')"
    )
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert (tmp_path / "cleaned").exists()
