"""The journal: framed lines, torn and damaged lines, attempts, fingerprints."""

from __future__ import annotations

import msgspec
import pytest

from gramcoord.engine.requests import EngineRequest, OutputRecord
from gramcoord.launch.config import load_config
from gramcoord.launch.journal import (
    JournalWriter,
    OutputLine,
    RankJournal,
    attempts,
    config_fingerprint,
    frame,
    read_lines,
    read_prior,
    request_fingerprint,
    resume_problem,
    unframe,
)


def record(rid: str, text: str = "{}") -> OutputRecord:
    return OutputRecord(id=rid, status="ok", finish_reason="grammar_end", text=text, token_ids=[1])


def test_a_line_round_trips_and_any_damage_is_detected():
    line = frame(b'{"a": 1}')
    assert unframe(line) == b'{"a": 1}'
    assert unframe(line[:-1]) is None  # cut before its newline
    assert unframe(line[:5]) is None
    damaged = bytearray(line)
    damaged[12] ^= 0x01
    assert unframe(bytes(damaged)) is None
    assert unframe(b"zzzzzzzz {}\n") is None


@pytest.mark.parametrize("fsync_s", [0.0, 0.05])
def test_a_torn_last_line_is_dropped_and_the_rest_read_back(tmp_path, fsync_s):
    path = tmp_path / "outputs-rank0.jsonl"
    w = JournalWriter(path, fsync_s=fsync_s)
    for i in range(5):
        w.append(b'{"i": %d}' % i)
    w.close()
    assert w.lines == 5
    data = path.read_bytes()
    path.write_bytes(data[:-7])  # a kill mid-write
    good, dropped = read_lines(path)
    assert good == [b'{"i": %d}' % i for i in range(4)] and dropped == 1


def test_prior_attempts_keep_the_first_line_of_each_request(tmp_path):
    fps = {"a": "fa", "b": "fb"}
    for attempt in (0, 1):
        j = RankJournal(
            tmp_path, attempt, 0, fsync_s=0, fingerprints=fps, outputs=True, digests=True
        )
        j.output(record("a", f"attempt {attempt}"))
        j.request_digests("a", [(0, 11), (1, 12)])
        j.request_digests("b", [(0, 21)])  # its output never made it
        j.close()
    assert attempts(tmp_path) == [0, 1]
    first = read_prior(tmp_path, before=1)
    assert first.attempts == 1 and list(first.outputs) == ["a"]
    assert first.outputs["a"].fp == "fa" and first.outputs["a"].record.text == "attempt 0"
    # Only digests of requests whose output survived.
    assert [(d.request_id, d.position) for d in first.digests[0]] == [("a", 0), ("a", 1)]
    both = read_prior(tmp_path)
    assert both.attempts == 2 and both.outputs["a"].record.text == "attempt 0"


def test_a_changed_request_or_config_refuses_to_resume(tmp_path):
    config = load_config()
    fp = config_fingerprint(config)
    req = EngineRequest(request_id="a", spec={"regex": "x+"}, prompt="p")
    j = RankJournal(
        tmp_path,
        0,
        0,
        fsync_s=0,
        fingerprints={"a": request_fingerprint(fp, req)},
        outputs=True,
        digests=False,
    )
    j.output(record("a"))
    j.close()
    prior = read_prior(tmp_path)
    assert resume_problem(prior, [req], fp) is None
    changed = msgspec.structs.replace(req, max_tokens=req.max_tokens + 1)
    assert "changed since the run being resumed" in resume_problem(prior, [changed], fp)
    other = msgspec.structs.replace(
        config, sampling=msgspec.structs.replace(config.sampling, seed=7)
    )
    assert "changed" in resume_problem(prior, [req], config_fingerprint(other))
    assert "not in this workload" in resume_problem(prior, [], fp)
    # Deadlines and batch sizes are not part of it: a resume may change them.
    wider = msgspec.structs.replace(
        config, scheduler=msgspec.structs.replace(config.scheduler, max_num_seqs=3)
    )
    assert config_fingerprint(wider) == fp


def test_an_output_line_is_one_json_object(tmp_path):
    j = RankJournal(tmp_path, 0, 3, fsync_s=0, fingerprints={"a": "f"}, outputs=True, digests=False)
    j.output(record("a"))
    j.close()
    (line,) = (tmp_path / "journal" / "attempt-0" / "outputs-rank3.jsonl").read_bytes().splitlines()
    got = msgspec.json.decode(line[9:], type=OutputLine)
    assert got.fp == "f" and got.record.id == "a"


def test_an_invalid_key_is_carried_into_the_next_attempt_and_a_timeout_is_not(tmp_path):
    from gramcoord.engine.requests import ErrorInfo
    from gramcoord.launch.journal import carried_poison
    from gramcoord.rank_worker.config import GrammarConfig
    from gramcoord.rank_worker.grammars.spec import validate_spec

    bad = {"regex": "(a"}
    reqs = [
        EngineRequest(request_id="bad", spec=bad),
        EngineRequest(request_id="slow", spec={"regex": "b+"}),
    ]
    j = RankJournal(tmp_path, 0, 0, fsync_s=0, fingerprints={}, outputs=True, digests=False)
    for rid, code in (("bad", "grammar_invalid"), ("slow", "grammar_timeout")):
        j.output(
            OutputRecord(id=rid, status="failed", finish_reason="error", error=ErrorInfo(code, "m"))
        )
    j.close()
    (record,) = carried_poison(read_prior(tmp_path), reqs, GrammarConfig(), "tiny")
    assert record.key == validate_spec(bad, GrammarConfig(), vocab="tiny").key
    assert record.reason == 20  # grammar_invalid: permanent


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["distributed.max_restarts=1", "output.journal=false"], "needs output.journal"),
        (["distributed.max_restarts=1", "launcher=inline"], "does not restart"),
    ],
)
def test_restarts_need_the_journal_and_torchrun(overrides, needle):
    from gramcoord.launch.config import ConfigError

    with pytest.raises(ConfigError, match=needle):
        load_config(overrides=overrides)
