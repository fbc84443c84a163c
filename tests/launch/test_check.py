"""gramcoord check: every record gets a line, bad ones included; exit 0."""

from __future__ import annotations

import io
import json
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from gramcoord.launch.check import run_check
from gramcoord.launch.cli import main
from gramcoord.launch.config import load_config
from gramcoord.launch.workload import parse_record


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        pytest.param(
            '{"id": "s", "schema": {"type": "object"}, "instances": [{"valid": true, "data": {"a": 1}}]}',
            "json",
            id="schema",
        ),
        pytest.param('{"id": "r", "kind": "regex", "regex": "^a+$"}', "regex", id="regex"),
        pytest.param(
            '{"id": "v", "prompt": "hi", "max_tokens": 9, "structured_outputs": {"choice": ["x"]}}',
            "choice",
            id="vllm",
        ),
    ],
)
def test_record_formats(line, kind):
    rec = parse_record(0, line)
    assert rec.error is None and kind in rec.spec


def test_schema_record_reference():
    rec = parse_record(
        0,
        '{"schema": {}, "instances": [{"valid": false, "data": 1}, {"valid": true, "data": {"k": "v"}}]}',
    )
    assert json.loads(rec.reference) == {"k": "v"}


WORKLOAD = "\n".join(
    [
        '{"id": "ok1", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}',
        '{"id": "dup", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}',
        # Too deep for the reader: this record alone fails (record_invalid).
        '{"structured_outputs": {"json": ' + "[" * 2000 + "]" * 2000 + "}}",
        '{"id": "unique", "schema": {"type": "array", "uniqueItems": true}}',
        '{"id": "re", "kind": "regex", "regex": "[0-9]{3}-[a-z]+"}',
        '{"id": "badre", "kind": "regex", "regex": "(unclosed"}',
        '{"id": "badre2", "kind": "regex", "regex": "(unclosed"}',
        '{"id": "vllm", "structured_outputs": {"choice": ["yes", "no"]}}',
        "",
        '{"id": "empty", "structured_outputs": {"choice": []}}',
    ]
)


def test_check_lines_and_summary(tmp_path, tiny_tokenizer, monkeypatch):
    path = tmp_path / "w.jsonl"
    path.write_text(WORKLOAD)
    monkeypatch.setattr("gramcoord.launch.check.load_tokenizer", lambda cfg: tiny_tokenizer)
    out = io.BytesIO()
    summary = run_check(load_config(), str(path), out)
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [ln["id"] for ln in lines] == [
        "ok1",
        "dup",
        "line-3",
        "unique",
        "re",
        "badre",
        "badre2",
        "vllm",
        "empty",
    ]
    by_id = {ln["id"]: ln for ln in lines}
    assert by_id["ok1"]["status"] == "ok" and by_id["ok1"]["cache"] == "miss"
    assert by_id["dup"]["status"] == "ok" and by_id["dup"]["cache"] in ("joined", "hit")
    assert by_id["line-3"]["code"] == "record_invalid"
    # Admitted, named, and checked at the end (reject_ignored_features is off).
    assert by_id["unique"]["status"] == "ok"
    assert by_id["unique"]["warnings"][0].startswith("ignored_feature")
    assert by_id["badre"]["code"] == "grammar_invalid"
    assert by_id["badre2"]["code"] == "grammar_invalid" and by_id["badre2"]["cache"] in (
        "joined",
        "poisoned",
    )
    assert by_id["empty"]["code"] == "spec_empty_choice"
    assert set(lines[0]) == {"id", "status", "code", "message", "warnings", "compile_ms", "cache"}
    # The summary is exactly the per-line file, counted.
    assert summary.records == len(lines)
    assert summary.by_status == dict(Counter(ln["status"] for ln in lines))
    assert summary.by_cache == dict(Counter(ln["cache"] for ln in lines))


def test_cli_exit_codes(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setattr("gramcoord.launch.check.load_tokenizer", lambda cfg: tiny_tokenizer)
    path = tmp_path / "w.jsonl"
    path.write_text('{"id": "x", "kind": "regex", "regex": "(bad"}\n')
    out = tmp_path / "o.jsonl"
    assert (
        main(["check", str(path), "--out", str(out), "--set", "grammar.compile_timeout_s=3"]) == 0
    )
    assert json.loads(out.read_text())["status"] == "invalid"
    assert main(["check", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["check", str(path), "--set", "grammar.compile_timeout_s=oops"]) == 2


def test_a_badly_shaped_workload_fails_before_compiling(tmp_path, capsys):
    path = tmp_path / "w.jsonl"
    path.write_text(
        '{"id": "a", "prompt": "x"}\n{"id": "b", "structured_output": {"regex": "a"}}\n'
    )
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: $.structured_output: unknown field" in err
    path.write_text("")
    assert main(["check", str(path)]) == 2
    assert "no records" in capsys.readouterr().err


def test_check_runs_anywhere_and_logs_beside_out(tmp_path, tiny_tokenizer, monkeypatch):
    """From another folder: the default workload is the package's, the native
    log goes beside --out FILE, nothing lands in runs/."""
    monkeypatch.setattr("gramcoord.launch.check.load_tokenizer", lambda cfg: tiny_tokenizer)
    monkeypatch.chdir(tmp_path)
    # The stdout case keeps its folder when the native log is not empty
    # (anything on fd 2 meanwhile): it must land in tmp_path, not /tmp.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    seen = []
    monkeypatch.setattr(
        "gramcoord.launch.check.native_stderr_redirected",
        _spy(seen, __import__("gramcoord.launch.check", fromlist=["x"]).native_stderr_redirected),
    )
    monkeypatch.setattr("gramcoord.launch.check.run_check", lambda cfg, wl, out: seen.append(wl))
    out = tmp_path / "sub" / "o.jsonl"
    assert main(["check", "--out", str(out)]) == 0
    assert Path(seen[0]) == out.parent and Path(seen[1]).name == "workload.jsonl"
    assert Path(seen[1]).is_file() and not (tmp_path / "runs").exists()
    # To stdout: a fresh temporary folder (removed when its log is empty).
    assert main(["check"]) == 0
    assert Path(seen[2]).name.startswith("gramcoord-check-")
    assert Path(seen[2]).parent == Path(tempfile.gettempdir())


def _spy(seen, real):
    def redirected(folder, rank):
        seen.append(str(folder))
        return real(folder, rank)

    return redirected
