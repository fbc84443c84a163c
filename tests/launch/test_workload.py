"""Workload records, the shipped default workload, and where dev data is found."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import xgrammar as xgr

from gramcoord.launch import workload as workload_mod
from gramcoord.launch.workload import (
    WorkloadError,
    dev_data_dir,
    load_workload,
    parse_record,
    read_workload,
)
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.grammars.manager import GrammarManager
from tests.load import scaled

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "configs" / "workload.jsonl"


@pytest.mark.parametrize(
    ("line", "constrained"),
    [
        pytest.param('{"id": "p", "prompt": "hi", "max_tokens": 8}', False, id="plain"),
        pytest.param(
            '{"id": "p", "prompt": "hi", "max_tokens": 8, "structured_outputs": {"regex": "a+"}}',
            True,
            id="constrained",
        ),
        # A spec with no kind is a bad spec (its record fails), not an
        # unconstrained request.
        pytest.param(
            '{"id": "p", "prompt": "hi", "max_tokens": 8, "structured_outputs": {}}',
            True,
            id="empty-spec",
        ),
    ],
)
def test_unconstrained_records(line, constrained):
    rec = parse_record(0, line)
    assert rec.constrained is constrained and rec.error is None
    assert rec.prompt == "hi" and rec.max_tokens == 8
    if not constrained:
        assert rec.spec is None


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        pytest.param(
            '{"id": "p", "structured_output": {"regex": "a"}}',
            "$.structured_output: unknown field (did you mean `structured_outputs`?)",
            id="typo-structured_output",
        ),
        pytest.param(
            '{"prompt": "hi", "max_tokens": "lots"}',
            "$.max_tokens: expected `int`, got `str`",
            id="max_tokens-str",
        ),
        pytest.param(
            '{"prompt": "hi", "max_tokens": 0}',
            "$.max_tokens: expected `int` >= 1",
            id="max_tokens-0",
        ),
        pytest.param('{"id": 7, "prompt": "hi"}', "$.id: expected `str`, got `int`", id="id-int"),
        pytest.param('{"prompt": ["hi"]}', "$.prompt: expected `str`", id="prompt-list"),
        pytest.param(
            '{"schema": {}, "instances": [{"valid": "yes", "data": 1}]}',
            "$.instances[0].valid: expected `bool`",
            id="instance-valid-str",
        ),
        pytest.param("{nope", "not JSON", id="not-json"),
        pytest.param("[1]", "$: expected `object`, got `array`", id="not-object"),
        pytest.param(
            '{"id": "p", "prompt": ""}', "no structured_outputs, schema or regex", id="blank-prompt"
        ),
        pytest.param(
            '{"id": "p", "max_tokens": 8}', "no structured_outputs, schema or regex", id="no-prompt"
        ),
        pytest.param(
            '{"schema": {}, "structured_outputs": {"regex": "a"}}',
            "set one of structured_outputs, schema",
            id="two-specs",
        ),
    ],
)
def test_shape_errors_name_the_file_line_and_field(line, needle):
    with pytest.raises(WorkloadError) as info:
        parse_record(3, line, source="w.jsonl")
    assert str(info.value).startswith("w.jsonl:4: ")
    assert needle in str(info.value)


def test_load_workload_lists_the_first_errors_by_1_based_line(tmp_path):
    path = tmp_path / "w.jsonl"
    bad = [f'{{"id": "b{i}", "structured_output": {{}}}}' for i in range(7)]
    path.write_text('{"prompt": "ok"}\n\n' + "\n".join(bad) + "\n")
    with pytest.raises(WorkloadError) as info:
        load_workload(path)
    text = str(info.value)
    assert text.startswith("7 records of the wrong shape:")
    # Blank lines count: the first bad record is on line 3.
    assert f"{path}:3: $.structured_output" in text and f"{path}:7:" in text
    assert f"{path}:8:" not in text and "(+2 more)" in text
    assert len(info.value.problems) == 7


def test_empty_workload_fails(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(WorkloadError, match="no records"):
        load_workload(path)


def test_default_ids_are_1_based_lines_and_repeats_fail_alone(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"id": "x", "prompt": "b"}\n{"id": "x", "prompt": "c"}\n')
    recs = load_workload(path)
    assert [(r.id, r.line, r.index) for r in recs] == [
        ("line-1", 1, 0),
        ("x", 3, 1),
        ("x@line4", 4, 2),
    ]
    assert recs[1].error is None and recs[2].error == "request id 'x' repeats line 3"


def test_a_line_too_deep_to_parse_fails_alone():
    # Hostile content, not a typo: the record fails (record_invalid), the run goes on.
    line = '{"id": "deep", "structured_outputs": {"json": ' + "[" * 5000 + "]" * 5000 + "}}"
    rec = parse_record(4, line, source="w.jsonl")
    assert rec.id == "line-5" and "w.jsonl:5: nested deeper" in rec.error


def _data_files() -> list[Path]:
    shared = ROOT.parent / "shared" / "data"
    files = [ROOT / "tests" / "data" / n for n in ("schemas-dev.jsonl", "regexes-dev.jsonl")]
    files += [shared / n for n in ("schemas-dev.jsonl", "regexes-dev.jsonl")]
    return [f for f in files if f.is_file()] + [SHIPPED]


@pytest.mark.parametrize("path", _data_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_dev_data_records_are_accepted_as_they_are(path):
    recs = load_workload(path)
    assert recs and all(r.error is None for r in recs)
    if "schemas" in path.name:
        assert all("json" in r.spec for r in recs) and any(r.reference for r in recs)
    if "regexes" in path.name:
        assert all(isinstance(r.spec["regex"], str) for r in recs)


def test_hostile_corpus_decodes_and_only_the_deepest_line_fails_alone():
    recs = load_workload(ROOT / "tests" / "data" / "hostile" / "hostile.jsonl.gz")
    assert len(recs) >= 90
    assert [r.id for r in recs if r.error] == ["line-5"]


def test_make_workload_output_decodes(tmp_path):
    from gramcoord.launch.workload import dev_data_dir

    if dev_data_dir().resolve() == (ROOT / "tests" / "data").resolve():
        # configs/README.md: the generator wants the full dev data; the
        # subset a bare clone carries has fewer usable schemas than it picks.
        pytest.skip("make_workload.py needs the full dev data (../shared/data)")
    out = tmp_path / "w.jsonl"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "configs" / "make_workload.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert proc.returncode == 0, proc.stderr
    assert len(load_workload(out)) == len(load_workload(SHIPPED))


def _kind(raw: dict) -> str:
    so = raw.get("structured_outputs")
    if so is None:
        return "none"
    return next((k for k in so if k in ("json", "regex", "choice", "grammar", "json_object")), "?")


def test_shipped_workload_shape():
    raws = [json.loads(line) for line in SHIPPED.read_text().splitlines()]
    recs = list(read_workload(SHIPPED))
    assert 40 <= len(recs) <= 60
    assert len({r.id for r in recs}) == len(recs)
    assert all(r.error is None and r.prompt and r.max_tokens > 0 for r in recs)
    good = Counter(_kind(raw) for raw in raws if "expect_error" not in raw)
    assert good["json"] >= 25 and good["regex"] >= 6, good
    assert good["choice"] == good["grammar"] == 2 and good["json_object"] == 1, good
    assert [r.constrained for r in recs] == [_kind(raw) != "none" for raw in raws]
    assert good["none"] == 2
    # Every good schema request carries the reference the synthetic model follows.
    assert all(
        r.reference
        for r, raw in zip(recs, raws)
        if _kind(raw) == "json" and "expect_error" not in raw
    )
    # Bad records are spread over the run, not bunched at the end.
    bad_at = [i for i, raw in enumerate(raws) if "expect_error" in raw]
    assert len(bad_at) >= 5 and bad_at[0] < len(raws) // 4 and bad_at[-1] > len(raws) // 2


def test_shipped_workload_verdicts(tiny_tokenizer):
    """Good specs compile and accept their reference; bad ones fail with their code.

    Verdicts do not depend on the vocabulary, so the tiny one keeps this quick.
    """
    raws = [json.loads(line) for line in SHIPPED.read_text().splitlines()]
    recs = [r for r in read_workload(SHIPPED) if r.constrained]
    expect = {raw["id"]: raw.get("expect_error") for raw in raws}
    manager = GrammarManager(GrammarConfig(), tiny_tokenizer)
    got: dict[str, str | None] = {}
    cache: dict[str, str] = {}
    try:
        for rec in recs:
            out = manager.add(rec.id, rec.spec)
            if out.status == "failed":
                got[rec.id], cache[rec.id] = out.code, out.cache
            # Drain as we go, so a repeated bad spec meets its poisoned key.
            while manager.num_pending:
                manager.wait_pending(0.05)  # sleep on the compile pool, never spin
                for o in manager.step():
                    got[o.request_id], cache[o.request_id] = o.code, o.cache
        for rec in recs:
            if expect[rec.id] is None and rec.reference is not None:
                matcher = manager.matcher(rec.id)
                assert matcher.accept_string(rec.reference) and matcher.is_completed(), rec.id
    finally:
        manager.close()
    # The default admits what xgrammar would not enforce (end-checked): a
    # record generated as refused for it is admitted here.
    admitted = {"schema_unsupported_feature"}
    want = {r.id: None if expect[r.id] in admitted else expect[r.id] for r in recs}
    assert {rid: code for rid, code in got.items() if code is not None} == {
        rid: code for rid, code in want.items() if code is not None
    }
    repeated = [rid for rid, c in cache.items() if c == "poisoned"]
    assert len(repeated) == 1 and expect[repeated[0]] == "grammar_invalid"


def test_ebnf_reference_is_matched_exactly(tiny_tokenizer):
    # The one grammar with a reference: the reference text is accepted and
    # nothing after it.
    raws = [json.loads(line) for line in SHIPPED.read_text().splitlines()]
    (raw,) = [r for r in raws if _kind(r) == "grammar" and r.get("instances")]
    text = json.dumps(raw["instances"][0]["data"])
    compiled = xgr.GrammarCompiler(tiny_tokenizer.info).compile_grammar(
        raw["structured_outputs"]["grammar"]
    )
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string(text) and matcher.is_completed()
    assert not matcher.accept_string("x")


def _touch_data(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "schemas-dev.jsonl").write_text("")
    return folder


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "no-shared"])
def test_dev_data_dir_order(tmp_path, monkeypatch, shared):
    repo = tmp_path / "repo"
    own = _touch_data(repo / "tests" / "data")
    full = _touch_data(tmp_path / "shared" / "data") if shared else None
    monkeypatch.setattr(workload_mod, "REPO_ROOT", repo)
    monkeypatch.delenv(workload_mod.DATA_DIR_ENV, raising=False)
    assert dev_data_dir() == (full if shared else own)
    monkeypatch.setenv(workload_mod.DATA_DIR_ENV, str(own))
    assert dev_data_dir() == own


def test_repo_subset_is_complete():
    """tests/data stands alone: labels line up, licences travel with it."""
    data = ROOT / "tests" / "data"
    ids = [json.loads(x)["id"] for x in (data / "schemas-dev.jsonl").read_text().splitlines()]
    labels = (data / "schemas-dev.xgrammar-labels.jsonl").read_text().splitlines()
    assert ids == [json.loads(x)["id"] for x in labels]
    assert 60 <= len(ids) <= 120
    assert (data / "regexes-dev.jsonl").read_text().count("\n") >= 30
    assert {p.name for p in (data / "LICENSES").iterdir()} >= {
        "Apache-2.0.txt",
        "MIT-JSON-Schema-Test-Suite.txt",
    }
    assert sum(p.stat().st_size for p in data.rglob("*") if p.is_file()) < 1_500_000


def test_stream_repeats_mixes_and_keeps_ids_unique(tmp_path):
    import gzip
    import json

    from gramcoord.launch.workload import stream_workload

    main = tmp_path / "main.jsonl"
    main.write_text("".join(json.dumps({"id": f"m{i}", "prompt": "p"}) + "\n" for i in range(4)))
    mix = tmp_path / "mix.jsonl.gz"
    with gzip.open(mix, "wt") as f:
        f.write(json.dumps({"id": "h", "structured_outputs": {"regex": ""}}) + "\n\n")
    recs = list(stream_workload(main, repeat=2, mix_path=mix, mix_every=3))
    assert [r.id for r in recs] == [
        "m0#0", "m1#0", "h#0", "m2#0", "m3#0", "h#1", "m0#1", "m1#1", "h#2", "m2#1", "m3#1",
    ]  # fmt: skip
    assert [r.index for r in recs] == list(range(len(recs)))
    assert recs[2].spec == {"regex": ""} and not recs[0].constrained
    assert [r.id for r in stream_workload(main, repeat=3, limit=5)][-1] == "m0#1"
    # A single pass keeps the file's ids as they are.
    assert [r.id for r in stream_workload(main)] == ["m0", "m1", "m2", "m3"]
