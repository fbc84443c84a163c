"""A JSON output is JSON: a bounded string never takes a raw control character, and an
output that fails ``json.loads`` is never ``ok``.

The synthetic model follows each record's reference, which puts a raw TAB,
a raw ``\\x01`` or a raw newline inside a string bounded by ``maxLength``.
Through our runner (the real tokenizer, matcher and step loop) the grammar
refuses each of them, and the outputs are JSON. With the compile a host
would make without ``json_strings`` (xgrammar as it is), the TAB and
``\\x01`` outputs are not JSON: they fail with ``output_not_json``, and the
run summary counts them in ``json_checks``.
"""

from __future__ import annotations

import json

import pytest

from gramcoord.engine.loop import run_loop
from gramcoord.engine.models import SyntheticModel
from gramcoord.engine.requests import EngineRequest
from gramcoord.engine.sampler import Sampler
from gramcoord.launch.summary import merge
from gramcoord.rank_worker.config import SamplingConfig
from gramcoord.rank_worker.grammars.end_check import wants_json
from gramcoord.rank_worker.grammars.json_strings import SafeStrings
from gramcoord.rank_worker.session.session import RankSession
from tests.rank_worker.session_helpers import session_config

SCHEMA = {
    "type": "object",
    "properties": {"note": {"type": "string", "maxLength": 24}},
    "required": ["note"],
}
CHARS = {"tab": "\t", "x01": "\x01", "newline": "\n"}
RECORDS = [
    EngineRequest(
        request_id=name,
        spec={"json": SCHEMA},
        reference='{"note": "ab' + char + 'cd"}',
        max_tokens=32,
    )
    for name, char in CHARS.items()
] + [EngineRequest(request_id="plain", spec={"json": SCHEMA}, reference='{"note": "abcd"}')]


def _run(tokenizer):
    config = session_config()
    session = RankSession.local(tokenizer, config)
    try:
        report = run_loop(
            session,
            RECORDS,
            SyntheticModel(tokenizer),
            Sampler(SamplingConfig()),
            config.speculative,
        )
    finally:
        session.close()
    outputs, summary = merge([report], RECORDS, replicated=False, wall_s=1.0, config={})
    return {o.id: o for o in outputs}, summary


def test_a_bounded_string_never_takes_a_raw_control_character(qwen_tokenizer):
    out, summary = _run(qwen_tokenizer)
    for name, o in out.items():
        assert (o.status, o.finish_reason, o.json_check) == ("ok", "grammar_end", "passed"), o
        note = json.loads(o.text)["note"]
        assert not any(ord(c) < 0x20 for c in note), (name, note)
    assert json.loads(out["plain"].text) == {"note": "abcd"}
    assert summary.json_checks == {"checked": 4, "failed": 0}
    assert summary.requests["ok"] == 4


def test_an_output_that_is_not_json_is_never_ok(qwen_tokenizer, monkeypatch):
    # The compile of a host without json_strings: xgrammar as it is.
    def as_xgrammar_alone(self, schema, **options):
        return self._compiler.compile_json_schema(schema, **options)

    monkeypatch.setattr(SafeStrings, "compile_json_schema", as_xgrammar_alone)
    out, summary = _run(qwen_tokenizer)
    for name in ("tab", "x01"):
        o = out[name]
        assert CHARS[name] in o.text  # the grammar let it through
        assert (o.status, o.finish_reason, o.json_check) == ("failed", "grammar_end", "failed")
        assert o.error.code == "output_not_json"
        assert "the output is not JSON: Invalid control character" in o.error.message
    # A raw newline xgrammar refuses even there; the plain record is JSON.
    assert (out["newline"].status, out["plain"].status) == ("ok", "ok")
    assert summary.json_checks == {"checked": 4, "failed": 2}
    assert summary.requests["by_error"] == {"output_not_json": 2}


@pytest.mark.parametrize(
    ("spec", "checked"),
    [
        pytest.param({"json": SCHEMA}, True, id="json"),
        pytest.param({"json": json.dumps(SCHEMA)}, True, id="json-text"),
        pytest.param({"json_object": True}, True, id="json-object"),
        pytest.param({"regex": "[a-z]+"}, False, id="regex"),
        pytest.param({"choice": ["a", "b"]}, False, id="choice"),
        pytest.param('{"json": {"type": "integer"}}', True, id="spec-as-text"),
    ],
)
def test_which_requests_are_json_checked(spec, checked):
    assert wants_json(spec) is checked
