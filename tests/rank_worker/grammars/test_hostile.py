"""The hostile-input corpus (tests/data/hostile/) through one rank's session.

Each corpus line goes the way a run takes it: ``parse_record`` (the
workload reader), then ``RankSession.submit`` and ``step`` with the real
Qwen2.5 vocabulary, so validation and the real compile both run. A record
that must fail fails with its code; one that is legitimately accepted is
admitted (with its warning, if it expects one). Nothing raises, and every
entry settles within the helper's deadline. One session serves the whole
corpus, so a hostile entry that broke the session would fail the ones
after it too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gramcoord.launch.workload import parse_record
from tests.data.hostile import make_hostile
from tests.rank_worker.session_helpers import local_session, settle

CORPUS: list[make_hostile.CorpusLine] = make_hostile.read_corpus()


def submit_line(session, entry: make_hostile.CorpusLine) -> tuple[str, object]:
    """(outcome code or "admitted", the outcome) for one corpus line."""
    rec = parse_record(entry.index, entry.line)
    if rec.error is not None:
        # What the run's origin records for a line the reader could not use.
        return "record_invalid", rec.error
    assert rec.id == entry.id
    spec = rec.spec
    if entry.encoding == "surrogateescape":
        # The raw bytes a client sent (lone surrogates stand for bad bytes).
        spec = spec.encode("utf-8", "surrogateescape")
    out = session.leader.submit(entry.id, spec, max_tokens=rec.max_tokens)
    if out.status == "failed":
        return out.code, out
    admitted, failed = settle(session, timeout_s=600)
    (decided,) = [o for o in admitted + failed if o.request_id == entry.id]
    if decided.status == "failed":
        return decided.code, decided
    session.leader.release(entry.id)
    return "admitted", decided


def test_corpus_is_what_the_script_writes(tmp_path: Path):
    make_hostile.main(["--out", str(tmp_path)])
    # Compared as text: gzip bytes could differ under another zlib build.
    written = make_hostile.read_corpus(tmp_path / make_hostile.CORPUS)
    assert [e.line for e in written] == [e.line for e in CORPUS]
    readme = (make_hostile.HERE / "README.md").read_text(encoding="utf-8")
    assert (tmp_path / "README.md").read_text(encoding="utf-8") == readme


def test_corpus_covers_the_issue():
    ids = [e.id for e in CORPUS]
    groups = {i.split("/")[1] for i in ids}
    assert groups == {
        "nesting", "size", "regex", "text", "unsat", "ref", "grammar", "kind", "length", "required"
    }  # fmt: skip
    for kind in ("json", "regex", "choice", "grammar", "json_object", "structural_tag"):
        assert any(i.startswith(f"hostile/kind/{kind}-") for i in ids), kind
    assert {e.expect.get("finish") for e in CORPUS} == {None, "grammar_end", "length"}
    assert all(set(e.expect) in ({"code"}, {"finish"}, {"finish", "warning"}) for e in CORPUS)


@pytest.mark.slow
def test_every_entry_gets_its_outcome(qwen_tokenizer):
    # Deadlines are not under test here: a compile that takes a second on a
    # quiet machine (enum-10k) may take many on a busy one.
    # The corpus's codes are those of a session that refuses what xgrammar
    # would not enforce (the default admits it and checks the output).
    session = local_session(qwen_tokenizer, compile_timeout_s=600.0, reject_ignored_features=True)
    wrong = []
    try:
        for entry in CORPUS:
            got, outcome = submit_line(session, entry)
            want = entry.expect.get("code", "admitted")
            if got != want:
                wrong.append((entry.id, want, got, getattr(outcome, "message", outcome)))
                continue
            if "code" in entry.expect and got != "record_invalid":
                assert outcome.message, entry.id  # a message a user can act on
            warning = entry.expect.get("warning")
            if warning:
                assert any(w.startswith(warning) for w in outcome.warnings), entry.id
        # The session still serves ordinary requests after all of that.
        assert session.leader.submit("after", {"regex": "ab+"}).status == "pending"
        admitted, failed = settle(session)
        assert [o.request_id for o in admitted] == ["after"] and not failed
    finally:
        session.close()
    assert wrong == []
