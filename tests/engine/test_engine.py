"""The step loop's parts: frames, draft acceptance, the scheduler, one-process runs,
and the run summary's merge of rank reports."""

from __future__ import annotations

import itertools
import json

import msgspec
import pytest

from gramcoord.engine import messages
from gramcoord.engine.acceptance import accepted_tokens, finish_reason
from gramcoord.engine.loop import RankReport, replica_requests, run_loop
from gramcoord.engine.messages import (
    Arrivals,
    BatchFrame,
    NewRequest,
    Scheduled,
    StageFailure,
    StepResults,
    Submitted,
    TokenResult,
)
from gramcoord.engine.models import SyntheticModel
from gramcoord.engine.requests import EngineRequest, ErrorInfo, OutputRecord
from gramcoord.engine.sampler import Sampler
from gramcoord.engine.scheduler import Scheduler
from gramcoord.launch.summary import Mismatch, digests_by_request, merge
from gramcoord.launch.validity import JsonChecker
from gramcoord.rank_worker.config import SamplingConfig, SpeculativeConfig
from gramcoord.rank_worker.grammars.manager import ManagerStats
from gramcoord.rank_worker.grammars.outcome import Outcome
from gramcoord.rank_worker.session.digest import DigestRecord, MaskDigests
from gramcoord.rank_worker.session.session import RankSession, SessionConfig, SessionStats
from tests.rank_worker.session_helpers import session_config

# -- frames ---------------------------------------------------------------------

MESSAGES = [
    Arrivals(step=0),
    Arrivals(
        step=3,
        requests=(Submitted("a", 0, '{"regex": "a+"}'), Submitted("é-ü", 7, '{"choice": ["x"]}')),
    ),
    BatchFrame(step=0),
    BatchFrame(
        step=5,
        started=(
            NewRequest("a", True, (1, 2, 3), '{"k": 1}', 64),
            NewRequest("u", False, (), None, 8),
        ),
        batch=(Scheduled("a", 2, (4, 5), (6, 7, 8)), Scheduled("u", 0, (), ())),
        finished=("x", "y"),
        failed_upstream=(StageFailure("b", "grammar_stage_timeout", "not compiled"),),
        done=True,
    ),
    StepResults(step=0),
    StepResults(
        step=9,
        results=(
            TokenResult("a", 1, (7,), (8, 9)),
            TokenResult("b", 0, (), finish_reason="error", error_code="token_rejected"),
            TokenResult("c", 3, (1, 2), finish_reason="grammar_end", jumped=4, error_message=""),
        ),
    ),
]
TYPES = (Arrivals, BatchFrame, StepResults)


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: f"{type(m).__name__}")
def test_frames_round_trip(message):
    data = messages.encode(message)
    assert isinstance(data, bytes)
    again = messages.decode(data, type(message))
    assert again == message and type(again) is type(message)


@pytest.mark.parametrize(
    ("message", "kind"),
    [(m, t) for m in MESSAGES for t in TYPES if not isinstance(m, t)],
    ids=lambda x: type(x).__name__ if not isinstance(x, type) else x.__name__,
)
def test_frames_decode_of_the_wrong_type_raises(message, kind):
    with pytest.raises(msgspec.ValidationError):
        messages.decode(messages.encode(message), kind)


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.__name__)
def test_frames_decode_of_garbage_raises(kind):
    with pytest.raises(msgspec.DecodeError):
        messages.decode(b"\xc1\x00garbage", kind)
    with pytest.raises(msgspec.DecodeError):
        messages.decode(messages.encode(MESSAGES[1])[:-3], kind)


# -- acceptance: accepted_tokens, finish_reason --------------------------------------------------------------

STOP = 99
STOPS = frozenset({STOP})


@pytest.mark.parametrize(
    ("picks", "drafts", "room", "expected"),
    [
        pytest.param([1, 2, 3, 9], [1, 2, 3], 100, [1, 2, 3, 9], id="all-accepted-plus-bonus"),
        pytest.param([4], [], 100, [4], id="no-drafts"),
        pytest.param([5, 2, 3, 9], [1, 2, 3], 100, [5], id="first-draft-rejected"),
        pytest.param([1, 5, 3, 9], [1, 2, 3], 100, [1, 5], id="second-draft-rejected"),
        pytest.param([1, 2, 5, 9], [1, 2, 3], 100, [1, 2, 5], id="last-draft-rejected"),
        pytest.param([1, STOP, 3, 9], [1, STOP, 3], 100, [1, STOP], id="stop-inside-drafts"),
        pytest.param([STOP, 2, 3, 9], [1, 2, 3], 100, [STOP], id="stop-instead-of-draft"),
        pytest.param([1, 2, 3, STOP], [1, 2, 3], 100, [1, 2, 3, STOP], id="stop-as-bonus"),
        pytest.param([1, 2, 3, 9], [1, 2, 3], 2, [1, 2], id="room-limit"),
        pytest.param([1, 2, 3, 9], [1, 2, 3], 4, [1, 2, 3, 9], id="room-exact"),
        pytest.param([1, 2, 3, 9], [1, 2, 3], 0, [], id="no-room"),
        pytest.param([1, 2], [1], -3, [], id="negative-room"),
    ],
)
def test_accepted_tokens(picks, drafts, room, expected):
    assert accepted_tokens(picks, drafts, STOPS, room) == expected


@pytest.mark.parametrize(
    ("terminated", "accepted", "length", "expected"),
    [
        pytest.param(True, [1, STOP], 5, "grammar_end", id="grammar-took-its-stop"),
        pytest.param(True, [1], 8, "grammar_end", id="terminated-beats-length"),
        pytest.param(False, [1, STOP], 5, "stop", id="stop-without-grammar"),
        pytest.param(False, [STOP], 8, "stop", id="stop-beats-length"),
        pytest.param(False, [1, 2], 8, "length", id="at-max-tokens"),
        pytest.param(False, [1, 2], 7, None, id="runs-on"),
        pytest.param(False, [], 3, None, id="nothing-accepted"),
    ],
)
def test_finish_reason(terminated, accepted, length, expected):
    got = finish_reason(
        terminated=terminated, accepted=accepted, stop_ids=STOPS, length=length, max_tokens=8
    )
    assert got == expected


# -- Scheduler ---------------------------------------------------------------------


class FakeSubmit:
    """The session's submit: sequence numbers, and failures on request."""

    def __init__(self, fail: dict[str, str] | None = None, no_seq: tuple[str, ...] = ()) -> None:
        self.fail = fail or {}
        self.no_seq = no_seq
        self.calls: list[tuple[str, object]] = []
        self._seq = itertools.count()

    def __call__(self, rid, spec, *, max_tokens=None) -> Outcome:
        self.calls.append((rid, spec))
        if rid in self.no_seq:
            return Outcome(request_id=rid, seq=-1, status="failed", code="bad_request_id")
        seq = next(self._seq)
        if rid in self.fail:
            return Outcome(
                request_id=rid,
                seq=seq,
                status="failed",
                code=self.fail[rid],
                message="nope",
                cache="none",
            )
        return Outcome(request_id=rid, seq=seq, status="pending", cache="miss")


def admitted(rid: str, seq: int, **kw) -> Outcome:
    return Outcome(request_id=rid, seq=seq, status="admitted", cache="hit", **kw)


def creq(rid: str, **kw) -> EngineRequest:
    return EngineRequest(request_id=rid, spec={"regex": f"{rid}+"}, **kw)


def ureq(rid: str, **kw) -> EngineRequest:
    return EngineRequest(request_id=rid, constrained=False, prompt="hi", **kw)


WORKLOAD = [
    creq("c0"),
    ureq("u1"),
    creq("c2"),
    EngineRequest(request_id="bad", error="not JSON"),
    creq("c3"),
    creq("c0"),  # a duplicate of a live id
    creq("f4"),
    creq("c5", max_tokens=7, reference="c5c5"),
]


def test_origin_arrivals_all_at_once(tiny_tokenizer):
    submit = FakeSubmit(fail={"f4": "spec_bad_json"})
    scheduler = Scheduler(WORKLOAD, tiny_tokenizer, submit, max_num_seqs=4)
    assert not scheduler.idle and scheduler.num_requests == len(WORKLOAD)
    arrivals = scheduler.arrive(0)
    assert arrivals.step == 0
    # Constrained requests only, failed submissions included (they hold a seq).
    assert [(s.request_id, s.seq) for s in arrivals.requests] == [
        (r, i) for i, r in enumerate(["c0", "c2", "c3", "f4", "c5"])
    ]
    assert json.loads(arrivals.requests[0].spec_json) == {"regex": "c0+"}
    assert [c[0] for c in submit.calls] == ["c0", "c2", "c3", "f4", "c5"]
    out = scheduler.outputs
    assert out["bad"].status == "failed" and out["bad"].error.code == "record_invalid"
    assert out["f4"].error == ErrorInfo("spec_bad_json", "nope")
    assert out["f4"].finish_reason == "error"
    assert out["c0"].error.code == "duplicate_request_id"  # until the original finishes
    assert scheduler.arrive(1).requests == ()


def test_origin_arrivals_per_step(tiny_tokenizer):
    everything = Scheduler(WORKLOAD, tiny_tokenizer, FakeSubmit(), max_num_seqs=4).arrive(0)
    scheduler = Scheduler(WORKLOAD, tiny_tokenizer, FakeSubmit(), max_num_seqs=4, per_step=3)
    got = []
    for step in range(4):
        arrivals = scheduler.arrive(step)
        assert arrivals.step == step
        got += arrivals.requests
    assert tuple(got) == everything.requests
    first = Scheduler(WORKLOAD, tiny_tokenizer, FakeSubmit(), max_num_seqs=4, per_step=3)
    assert [s.request_id for s in first.arrive(0).requests] == ["c0", "c2"]


def test_origin_failed_submit_without_seq_is_not_forwarded(tiny_tokenizer):
    scheduler = Scheduler(
        [creq("a"), creq("b")], tiny_tokenizer, FakeSubmit(no_seq=("a",)), max_num_seqs=2
    )
    arrivals = scheduler.arrive(0)
    assert [s.request_id for s in arrivals.requests] == ["b"]
    assert scheduler.outputs["a"].error.code == "bad_request_id"


def test_origin_spec_that_is_not_json_fails_without_submitting(tiny_tokenizer):
    submit = FakeSubmit()
    scheduler = Scheduler(
        [EngineRequest(request_id="s", spec={"json": {1, 2}})],
        tiny_tokenizer,
        submit,
        max_num_seqs=2,
    )
    assert scheduler.arrive(0).requests == ()
    assert submit.calls == [] and scheduler.outputs["s"].error.code == "spec_bad_json"
    assert scheduler.idle


def _started(scheduler: Scheduler) -> Scheduler:
    scheduler.arrive(0)
    return scheduler


def test_origin_decided_plan_apply_finish(tiny_tokenizer):
    stop = tiny_tokenizer.stop_ids[0]
    reqs = [creq("c0", max_tokens=9), ureq("u1", max_tokens=5), creq("c2"), creq("c3")]
    scheduler = _started(Scheduler(reqs, tiny_tokenizer, FakeSubmit(), max_num_seqs=2))
    assert not scheduler.idle
    # Before any decision only the unconstrained request runs.
    f0 = scheduler.plan(0)
    assert [s.request_id for s in f0.batch] == ["u1"]
    assert f0.started == (NewRequest("u1", False, tuple(tiny_tokenizer.encode("hi")), None, 5),)
    scheduler.decided(
        [admitted("c0", 0), admitted("c2", 2, compile_ms=1.5)],
        [Outcome(request_id="c3", seq=3, status="failed", code="grammar_invalid", compile_ms=2.5)],
    )
    c3 = scheduler.outputs["c3"]
    assert (c3.status, c3.error.code, c3.compile_ms) == ("failed", "grammar_invalid", 2.5)
    # FIFO, capped at max_num_seqs; each request is started once.
    f1 = scheduler.plan(1)
    assert [s.request_id for s in f1.batch] == ["u1", "c0"]
    assert [n.request_id for n in f1.started] == ["c0"]
    assert f1.started[0].constrained and f1.started[0].max_tokens == 9
    assert f1.batch == (Scheduled("u1", 0, (), ()), Scheduled("c0", 0, (), ()))
    scheduler.apply(
        StepResults(
            step=1,
            results=(
                TokenResult("u1", 0, (104, 105), (33,)),
                TokenResult("c0", 0, (99, 48, 43), (43, 43), jumped=1),
                TokenResult("ghost", 0, (1,)),  # unknown ids are ignored
            ),
        )
    )
    f2 = scheduler.plan(2)
    assert f2.started == () and f2.finished == ()
    assert f2.batch == (
        Scheduled("u1", 0, (104, 105), (33,)),
        Scheduled("c0", 0, (99, 48, 43), (43, 43)),
    )
    # A rollback drops tokens before appending the new ones.
    scheduler.apply(
        StepResults(
            step=2,
            results=(
                TokenResult("c0", 2, (43, 43, 43)),
                TokenResult("u1", 0, (33, stop), finish_reason="stop"),
            ),
        )
    )
    u1 = scheduler.outputs["u1"]
    assert (u1.status, u1.finish_reason, u1.error) == ("ok", "stop", None)
    assert u1.text == "hi!" and u1.token_ids == [104, 105, 33, stop]
    assert u1.model_steps == 3 and u1.cache == "none"
    f3 = scheduler.plan(3)
    assert f3.finished == ("u1",)
    assert [n.request_id for n in f3.started] == ["c2"]
    assert f3.batch == (Scheduled("c0", 2, (43, 43, 43), ()), Scheduled("c2", 0, (), ()))
    # The change was handed on: the next frame carries none.
    assert scheduler.plan(4).batch[0] == Scheduled("c0", 0, (), ())
    scheduler.apply(
        StepResults(
            step=4,
            results=(
                TokenResult("c0", 0, (stop,), finish_reason="grammar_end", jumped=2),
                TokenResult(
                    "c2",
                    0,
                    (),
                    finish_reason="error",
                    error_code="token_rejected",
                    error_message="bad token",
                ),
            ),
        )
    )
    c0 = scheduler.outputs["c0"]
    assert c0.status == "ok" and c0.finish_reason == "grammar_end"
    assert c0.token_ids == [99, 43, 43, 43, stop] and c0.text == "c+++"
    assert (c0.cache, c0.model_steps, c0.jump_forward_tokens) == ("hit", 4, 3)
    c2 = scheduler.outputs["c2"]
    assert (c2.status, c2.finish_reason, c2.error) == (
        "failed",
        "error",
        ErrorInfo("token_rejected", "bad token"),
    )
    assert c2.compile_ms == 1.5
    assert scheduler.idle and scheduler.num_finished == 4
    last = scheduler.plan(5, done=True)
    assert last.done and last.batch == () and set(last.finished) == {"c0", "c2"}


def test_origin_idle_waits_for_pending_and_arrivals(tiny_tokenizer):
    scheduler = Scheduler(
        [creq("a"), creq("b")], tiny_tokenizer, FakeSubmit(), max_num_seqs=2, per_step=1
    )
    scheduler.arrive(0)
    scheduler.decided([], [Outcome(request_id="a", seq=0, status="failed", code="x")])
    assert not scheduler.idle  # "b" has not arrived
    scheduler.arrive(1)
    assert not scheduler.idle  # "b" is pending
    scheduler.decided([], [Outcome(request_id="b", seq=1, status="failed", code="x")])
    assert scheduler.idle


def test_replica_requests():
    reqs = [creq(f"r{i}") for i in range(5)]
    assert replica_requests(reqs, dp=2, replica=1, replicated=False) == [reqs[1], reqs[3]]
    assert replica_requests(reqs, dp=2, replica=0, replicated=False) == reqs[0::2]
    assert replica_requests(reqs, dp=2, replica=1, replicated=True) == reqs


# -- run_loop in one process (real vocabulary) ----------------------------------------

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
RECORDS = [
    EngineRequest(
        request_id="person",
        spec={"json": PERSON},
        reference='{"name": "Ada", "age": 36}',
        max_tokens=64,
    ),
    EngineRequest(
        request_id="flag",
        spec={
            "json": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
            }
        },
        max_tokens=32,
    ),
    EngineRequest(request_id="word", spec={"regex": "[a-z]{3,8}"}, max_tokens=16),
    EngineRequest(request_id="colour", spec={"choice": ["red", "green", "blue"]}, max_tokens=8),
    EngineRequest(
        request_id="ints",
        spec={"json": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
        reference="[1, 2, 3]",
        max_tokens=32,
    ),
    EngineRequest(request_id="obj", spec={"json_object": True}, max_tokens=24),
]
FREE = EngineRequest(
    request_id="free",
    constrained=False,
    prompt="Say it:",
    reference="free text here, then a few more words to overlap the others",
    max_tokens=40,
)


class RecordingModel(SyntheticModel):
    """The synthetic model, remembering which requests shared each forward call."""

    def __init__(self, tokenizer, **kw) -> None:
        super().__init__(tokenizer, **kw)
        self.calls: list[set[str]] = []

    def logits(self, rows):
        self.calls.append({request.request_id for request, _ in rows})
        return super().logits(rows)


def _run(tokenizer, records, k=0, per_step=0, *, mode="async", progress=None):
    """One run; returns the report and the request ids of every forward call."""
    config = SessionConfig(
        grammar=session_config(compile_mode=mode).grammar,
        speculative=SpeculativeConfig(num_tokens=k, drafter="replay"),
    )
    session = RankSession.local(tokenizer, config)
    model = RecordingModel(tokenizer, seed=0)
    try:
        report = run_loop(
            session,
            records,
            model,
            Sampler(SamplingConfig()),
            config.speculative,
            per_step=per_step,
            progress=progress,
        )
    finally:
        session.close()
    return report, model.calls


class Runs:
    """``runs(records, k, per_step, mode)`` -> RankReport, memoized per module."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.reports: dict[tuple, RankReport] = {}
        # id(report) -> the request ids of each forward call of that run.
        self.batches: dict[int, list[set[str]]] = {}

    def __call__(self, records, k: int = 0, per_step: int = 0, mode: str = "async"):
        key = (tuple(r.request_id for r in records), k, per_step, mode)
        if key not in self.reports:
            report, calls = _run(self.tokenizer, list(records), k, per_step, mode=mode)
            self.reports[key] = report
            self.batches[id(report)] = calls
        return self.reports[key]


@pytest.fixture(scope="module")
def run(qwen_tokenizer) -> Runs:
    return Runs(qwen_tokenizer)


def outputs_of(report: RankReport) -> dict[str, tuple]:
    return {o.id: (o.status, o.finish_reason, o.text, o.token_ids) for o in report.outputs}


def test_run_loop_finishes_every_request(qwen_tokenizer, run):
    report = run(tuple(RECORDS))
    assert (report.rank, report.coords) == (0, (0, 0, 0))
    out = {o.id: o for o in report.outputs}
    assert set(out) == {r.request_id for r in RECORDS}
    checker = JsonChecker()
    for r in RECORDS:
        o = out[r.request_id]
        assert o.status == "ok" and o.error is None, o
        assert o.finish_reason == "grammar_end"
        assert o.token_ids[-1] in qwen_tokenizer.stop_ids
        assert 0 < o.model_steps <= len(o.token_ids)
        assert checker.check(r.spec, o.text) in (True, None)
    assert checker.counts() == {"checked": 4, "parsed": 4, "valid": 4, "unverifiable": 0}
    # The synthetic model follows a reference where there is one.
    assert json.loads(out["person"].text) == {"name": "Ada", "age": 36}
    assert json.loads(out["ints"].text) == [1, 2, 3]
    assert out["colour"].text in ("red", "green", "blue")
    # One committed mask row per output position of every request.
    digests = MaskDigests.index(report.digests)
    assert digests and report.self_mismatches == 0
    for o in report.outputs:
        assert {p for rid, p in digests if rid == o.id} == set(range(len(o.token_ids)))
    stats = report.stats
    assert isinstance(stats, SessionStats)
    assert stats.manager.admitted == len(RECORDS) and stats.manager.miss == len(RECORDS)
    assert stats.rows_applied == len(digests)
    assert report.steps >= max(o.model_steps for o in report.outputs)
    assert report.bytes_sent == 0


def test_run_loop_is_deterministic(qwen_tokenizer, run):
    first = run(tuple(RECORDS))
    second, _ = _run(qwen_tokenizer, RECORDS)
    assert outputs_of(second) == outputs_of(first)
    assert MaskDigests.index(second.digests) == MaskDigests.index(first.digests)


@pytest.mark.parametrize("per_step", [1, 4])
def test_run_loop_arrivals_per_step_match_all_at_once(run, per_step):
    everything = run(tuple(RECORDS))
    staggered = run(tuple(RECORDS), 0, per_step)
    assert outputs_of(staggered) == outputs_of(everything)
    assert MaskDigests.index(staggered.digests) == MaskDigests.index(everything.digests)


def test_run_loop_speculative_matches_k0(run):
    plain = run(tuple(RECORDS))
    drafted = run(tuple(RECORDS), 3)
    assert outputs_of(drafted) == outputs_of(plain)
    assert MaskDigests.index(drafted.digests) == MaskDigests.index(plain.digests)
    assert drafted.self_mismatches == 0
    steps = lambda rep: sum(o.model_steps for o in rep.outputs)  # noqa: E731
    assert steps(drafted) < steps(plain)


@pytest.mark.parametrize("k", [0, 3])
def test_run_loop_mixed_batch_has_no_cross_request_contamination(run, k):
    """An unconstrained request is never masked by another's rows, and never shifts
    theirs (the TP-side apply skips it and aligns the others past it)."""
    # Sync compiles admit every request at step 0, so the free request (first
    # in every batch: it needs no admission) shares its batches with the others.
    alone = run((FREE,), k, 0, "sync")
    constrained = run(tuple(RECORDS), k, 0, "sync")
    mixed = run((*RECORDS[:3], FREE, *RECORDS[3:]), k, 0, "sync")
    shared = [ids for ids in run.batches[id(mixed)] if "free" in ids and len(ids) > 1]
    assert len(shared) >= 3
    free = outputs_of(alone)["free"]
    assert free[:3] == ("ok", "stop", FREE.reference)
    got = outputs_of(mixed)
    assert got.pop("free") == free
    assert got == outputs_of(constrained)
    assert MaskDigests.index(mixed.digests) == MaskDigests.index(constrained.digests)
    assert not alone.digests  # nothing was masked for it
    # Sync and async compiles give the same outputs.
    assert outputs_of(constrained) == outputs_of(run(tuple(RECORDS), k))


def test_run_loop_failures_still_finish(run, qwen_tokenizer):
    records = (
        EngineRequest(request_id="bad-spec", spec={"regex": ""}),
        EngineRequest(request_id="bad-regex", spec={"regex": "(a"}),
        EngineRequest(request_id="broken", error="line 3 is not JSON"),
        EngineRequest(request_id="short", spec={"regex": "[a-z]{6,8}"}, max_tokens=1),
        RECORDS[3],
    )
    seen = []
    report, _ = _run(qwen_tokenizer, list(records), progress=lambda a, b: seen.append((a, b)))
    out = {o.id: o for o in report.outputs}
    assert out["bad-spec"].error.code == "spec_blank"
    assert out["bad-regex"].error.code == "grammar_invalid"
    assert out["broken"].error.code == "record_invalid"
    assert (out["short"].status, out["short"].finish_reason) == ("ok", "length")
    assert len(out["short"].token_ids) == 1
    assert out["colour"].status == "ok"
    assert seen[-1] == (5, 5) and len(seen) == report.steps


def test_an_output_the_grammar_let_through_but_the_schema_forbids_is_never_ok(qwen_tokenizer):
    # xgrammar ignores dependentRequired, and over an open object no
    # rewrite can split it: the grammar admits {"a": 1}, the schema does
    # not. The request is admitted with a warning and its finished output
    # is checked at the end.
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": True,
        "dependentRequired": {"a": ["b"]},
    }
    records = [
        EngineRequest(request_id="breaks", spec={"json": schema}, reference='{"a": 1}'),
        EngineRequest(request_id="holds", spec={"json": schema}, reference='{"a": 1, "b": 2}'),
        EngineRequest(request_id="exact", spec={"json": {"type": "integer"}}, reference="7"),
    ]
    report, _ = _run(qwen_tokenizer, records)
    out = {o.id: o for o in report.outputs}
    broke = out["breaks"]
    assert (broke.status, broke.finish_reason, broke.end_check) == (
        "failed",
        "grammar_end",
        "failed",
    )
    assert broke.error.code == "schema_breach"
    assert "'b' is a dependency of 'a'" in broke.error.message
    assert broke.text == '{"a": 1}'  # kept, for the user to see
    assert any(w.startswith("ignored_feature") for w in broke.warnings)
    assert (out["holds"].status, out["holds"].end_check) == ("ok", "passed")
    assert (out["exact"].status, out["exact"].end_check) == ("ok", None)


# -- launch/summary.merge ----------------------------------------------------------


def _record(rid, tokens=(1, 2), status="ok", text="{}", **kw) -> OutputRecord:
    if status == "failed":
        kw.setdefault("error", ErrorInfo("grammar_invalid", "m"))
        kw.setdefault("finish_reason", "error")
    return OutputRecord(
        id=rid,
        status=status,
        finish_reason=kw.pop("finish_reason", "grammar_end"),
        text=text,
        token_ids=list(tokens),
        **kw,
    )


def _report(rank, coords, *, digests=(), outputs=(), steps=4, **kw) -> RankReport:
    return RankReport(
        rank=rank,
        coords=coords,
        steps=steps,
        wall_s=0.1,
        outputs=list(outputs),
        digests=[DigestRecord(*d) for d in digests],
        **kw,
    )


REQS = [
    EngineRequest(request_id="a", spec={"json": {"type": "object"}}),
    EngineRequest(request_id="b", spec={"regex": "x+"}),
]
ROWS = [("a", 0, 11), ("a", 1, 12), ("b", 0, 21)]


def test_merge_counts_a_differing_digest_and_names_the_odd_rank():
    odd = [("a", 0, 11), ("a", 1, 99), ("b", 0, 21)]
    reports = [
        _report(0, (0, 0, 0), digests=ROWS, outputs=[_record("a"), _record("b", text="xx")]),
        _report(1, (0, 0, 1), digests=odd),
        _report(2, (0, 0, 2), digests=ROWS),
    ]
    _, summary = merge(reports, REQS, replicated=False, wall_s=1.0, config={})
    det = summary.determinism
    assert det.mismatches == 1
    assert det.first == [Mismatch("mask digest", "a", 1, (1,))]
    assert (det.ranks_compared, det.rows_compared, det.steps_compared) == (3, 3, 4)


def test_merge_two_ranks_one_digest_differing():
    odd = [("a", 0, 11), ("a", 1, 12), ("b", 0, 22)]
    reports = [
        _report(0, (0, 0, 0), digests=ROWS, outputs=[_record("a"), _record("b")]),
        _report(1, (0, 0, 1), digests=odd),
    ]
    _, summary = merge(reports, REQS, replicated=False, wall_s=1.0, config={})
    det = summary.determinism
    assert det.mismatches == 1 and det.rows_compared == 3
    (m,) = det.first
    assert (m.what, m.request_id, m.position) == ("mask digest", "b", 0)
    assert len(m.ranks) == 1 and m.ranks[0] in (0, 1)


def test_merge_agreeing_ranks_and_self_mismatches():
    reports = [
        _report(0, (0, 0, 0), digests=ROWS, outputs=[_record("a")]),
        _report(1, (0, 0, 1), digests=ROWS, self_mismatches=2),
    ]
    _, summary = merge(reports, REQS, replicated=False, wall_s=1.0, config={})
    assert summary.determinism.mismatches == 2 and summary.determinism.first == []
    # A row only one rank holds is not compared.
    single = [_report(0, (0, 0, 0), digests=ROWS, outputs=[_record("a")])]
    _, summary = merge(single, REQS, replicated=False, wall_s=1.0, config={})
    assert summary.determinism.rows_compared == 0 and summary.determinism.steps_compared == 0


def test_merge_replicated_outputs_differing_are_counted():
    same = [_record("a", (1, 2)), _record("b", (3,), text="x")]
    other = [_record("a", (1, 2)), _record("b", (3, 4), text="xx")]
    reports = [
        _report(0, (0, 0, 0), outputs=same),
        _report(1, (1, 0, 0), outputs=same),
        _report(2, (2, 0, 0), outputs=other),
    ]
    outputs, summary = merge(reports, REQS, replicated=True, wall_s=1.0, config={})
    assert summary.determinism.mismatches == 1
    assert summary.determinism.first == [Mismatch("replica output", "b", -1, (2,))]
    assert [o.id for o in outputs] == ["a", "b"] and outputs[1].token_ids == [3]
    # Partitioned replicas are not compared; their outputs are merged.
    part = [
        _report(0, (0, 0, 0), outputs=[_record("a")]),
        _report(1, (1, 0, 0), outputs=[_record("b", text="x")]),
    ]
    outputs, summary = merge(part, REQS, replicated=False, wall_s=1.0, config={})
    assert [o.id for o in outputs] == ["a", "b"] and summary.determinism.mismatches == 0


def test_merge_summary_counts_and_json_validity():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    reqs = [
        EngineRequest(request_id="valid", spec={"json": schema}),
        EngineRequest(request_id="wrong", spec={"json": json.dumps(schema)}),
        EngineRequest(request_id="garbled", spec={"json": schema}),
        EngineRequest(request_id="any", spec={"json_object": True}),
        EngineRequest(request_id="remote", spec={"json": {"$ref": "http://example.com/s.json"}}),
        EngineRequest(request_id="regex", spec={"regex": "x+"}),
        EngineRequest(request_id="failed", spec={"json": schema}),
        EngineRequest(request_id="free", constrained=False),
    ]
    outs = [
        _record("valid", text='{"n": 1}', cache="miss", compile_ms=3.0, end_check="passed"),
        _record("wrong", text='{"n": "one"}', cache="hit"),
        _record("garbled", text='{"n": ', finish_reason="length"),
        _record("any", text="[1]"),
        _record("remote", text="{}"),
        _record("regex", text="xxx", tokens=(1, 2, 3)),
        _record("failed", status="failed", tokens=()),
        _record("free", text="hello", finish_reason="stop", jump_forward_tokens=2),
    ]
    stats = SessionStats(manager=ManagerStats(miss=3, hit=2, joined=1, poisoned=1))
    reports = [
        _report(0, (0, 0, 0), outputs=outs[::-1], stats=stats, timings={"agreement": [1.0, 3.0]})
    ]
    outputs, summary = merge(reports, reqs, replicated=False, wall_s=2.5, config={"k": 1})
    assert [o.id for o in outputs] == [r.request_id for r in reqs]  # workload order
    assert summary.json_valid == {"checked": 5, "parsed": 4, "valid": 1, "unverifiable": 1}
    assert summary.requests == {
        "total": 8,
        "ok": 7,
        "failed": 1,
        "by_error": {"grammar_invalid": 1},
    }
    assert summary.finish_reasons == {"grammar_end": 5, "length": 1, "error": 1, "stop": 1}
    assert summary.tokens["generated"] == 2 * 6 + 3 and summary.tokens["jump_forward_tokens"] == 2
    assert summary.cache == {"hits": 2, "misses": 3, "poisoned_hits": 1, "joined": 1, "warm": 0}
    assert summary.latency_ms["agreement"].count == 2
    assert summary.latency_ms["compile"].count == 1
    assert (summary.steps, summary.wall_s, summary.config) == (4, 2.5, {"k": 1})
    assert summary.end_checks == {"checked": 1, "failed": 0}
    outs[0] = _record(
        "valid",
        status="failed",
        end_check="failed",
        error=ErrorInfo("schema_breach", "the output breaks the schema at $"),
    )
    reports = [_report(0, (0, 0, 0), outputs=outs, stats=stats)]
    _, again = merge(reports, reqs, replicated=False, wall_s=2.5, config={})
    assert again.end_checks == {"checked": 1, "failed": 1}
    assert again.requests["by_error"]["schema_breach"] == 1


def test_json_checker_counts():
    checker = JsonChecker()
    schema = {"type": "array", "maxItems": 1}
    assert checker.check({"json": schema}, "[1]") is True
    assert checker.check({"json": schema}, "[1, 2]") is False
    assert checker.check({"json": schema}, "[1,") is False
    assert checker.check({"json": json.dumps(schema)}, "[]") is True
    assert checker.check({"json": "{not json"}, "[]") is None  # not counted
    assert checker.check({"json_object": True}, '{"a": 1}') is True
    assert checker.check({"json_object": True}, "1") is False
    assert checker.check({"regex": "a"}, "a") is None
    assert checker.check(None, "a") is None
    assert checker.check({"json": {"$ref": "http://example.com/x.json"}}, "1") is None
    assert checker.counts() == {"checked": 7, "parsed": 6, "valid": 3, "unverifiable": 1}


def test_digests_by_request_takes_the_lowest_rank():
    reports = [
        _report(3, (0, 0, 1), digests=[("a", 1, 5), ("a", 2, 6)]),
        _report(1, (0, 0, 0), digests=[("a", 1, 7), ("b", 0, 8), ("a", 0, 9)]),
    ]
    assert digests_by_request(reports) == {"a": [(0, 9), (1, 7), (2, 6)], "b": [(0, 8)]}
