"""RankSession in one process: submit, step, the stale-state contract, drafts,
apply/commit digests, typed stats, and the TP reader path over a real channel."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import pytest
import torch

from gramcoord.engine.acceptance import accepted_tokens
from gramcoord.rank_worker.errors import ErrorCode, GrammarError
from gramcoord.rank_worker.grammars.manager import ManagerStats
from gramcoord.rank_worker.masks.grammar_state import GrammarState
from gramcoord.rank_worker.masks.jump_forward import JumpStats
from gramcoord.rank_worker.session.applier import MaskApplier
from gramcoord.rank_worker.session.digest import MaskDigests, combine, row_digest
from gramcoord.rank_worker.session.reader import MaskReader
from gramcoord.rank_worker.session.session import (
    MaskBatch,
    RankSession,
    RoleError,
    SessionStats,
    StaleGrammarState,
)
from gramcoord.sync.channel import BitmaskChannel
from gramcoord.sync.config import TransportConfig
from tests.rank_worker.session_helpers import (
    admit,
    allowed,
    local_session,
    session_config,
    settle,
)

REGEX = "ab(c|d)ef"


@pytest.fixture
def tiny_session(tiny_tokenizer):
    session = local_session(tiny_tokenizer)
    yield session
    session.close()


@pytest.fixture
def spec_session(tiny_tokenizer):
    session = local_session(tiny_tokenizer, k=3)
    yield session
    session.close()


def ids(text: str) -> list[int]:
    """Tiny-vocabulary ids of ``text``: one byte, one token."""
    return list(text.encode())


# -- submit ---------------------------------------------------------------------


NAN = float("nan")
BAD_SPECS = [
    pytest.param(5, "spec_bad_type", id="int"),
    pytest.param(None, "spec_bad_type", id="none"),
    pytest.param(["regex", "a"], "spec_bad_type", id="list"),
    pytest.param(object(), "spec_bad_type", id="object"),
    pytest.param("{not json", "spec_bad_json", id="bad-json-text"),
    pytest.param({"regexp": "a"}, "spec_bad_type", id="unknown-field"),
    pytest.param({}, "spec_no_kind", id="no-kind"),
    pytest.param({"regex": "a", "choice": ["a"]}, "spec_multiple_kinds", id="two-kinds"),
    pytest.param({"choice": []}, "spec_empty_choice", id="empty-choice"),
    pytest.param({"regex": "   "}, "spec_blank", id="blank-regex"),
    pytest.param({"json_object": False}, "spec_json_object_false", id="json-object-false"),
    pytest.param({"regex": "a\x00b"}, "spec_regex_nul", id="regex-nul"),
    pytest.param({"json": {"type": "number", "maximum": NAN}}, "spec_bad_json", id="nan"),
    pytest.param({"json": {"type": "number", "minimum": -math.inf}}, "spec_bad_json", id="inf"),
    pytest.param({"json": '{"type": "number", "maximum": NaN}'}, "spec_bad_json", id="nan-text"),
    pytest.param({"json": False}, "spec_bad_json", id="schema-false"),
]


@pytest.mark.parametrize(("spec", "code"), BAD_SPECS)
def test_submit_bad_spec_fails_with_its_code(tiny_session, spec, code):
    out = tiny_session.leader.submit("r1", spec)
    assert (out.request_id, out.status, out.code) == ("r1", "failed", code)
    assert code in ErrorCode.__members__
    assert out.message
    # Nothing was queued: the id is free and no step admits anything.
    assert tiny_session._roles.manager.num_pending == 0
    assert tiny_session.leader.submit("r1", {"regex": "a"}).status == "pending"


@pytest.mark.parametrize(
    "request_id", ["", 7, None, b"r1", "x" * 5000], ids=["empty", "int", "none", "bytes", "long"]
)
def test_submit_bad_request_id(tiny_session, request_id):
    out = tiny_session.leader.submit(request_id, {"regex": "a"})
    assert out.status == "failed" and out.code == "bad_request_id"
    assert len(out.request_id) <= 64
    assert tiny_session._roles.manager.num_pending == 0


def test_submit_duplicate_id_while_live_then_free_after_finish(tiny_session):
    s = tiny_session
    assert s.leader.submit("dup", {"regex": "a"}).status == "pending"
    again = s.leader.submit("dup", {"regex": "b"})
    assert (again.status, again.code) == ("failed", "duplicate_request_id")
    admitted, _ = settle(s)
    assert [o.request_id for o in admitted] == ["dup"]
    assert s.masks.is_running("dup")
    assert s.leader.submit("dup", {"regex": "a"}).code == "duplicate_request_id"
    s.leader.release("dup")
    assert not s.masks.is_running("dup")
    assert s.leader.submit("dup", {"regex": "a"}).status == "pending"


def test_submit_explicit_seq_must_increase(tiny_session):
    s = tiny_session
    assert s.leader.submit("a", {"regex": "a"}, seq=5).seq == 5
    for seq in (5, 3):
        out = s.leader.submit("b", {"regex": "a"}, seq=seq)
        assert (out.status, out.code, out.seq) == ("failed", "bad_request_id", seq)
        assert "increase" in out.message
    # The refused calls consumed nothing: the next implicit seq follows 5.
    nxt = s.leader.submit("c", {"regex": "a"})
    assert (nxt.status, nxt.seq) == ("pending", 6)
    # "b" was never queued, so its id is still free.
    assert s.leader.submit("b", {"regex": "a"}, seq=9).status == "pending"
    admitted, failed = settle(s)
    assert sorted(o.request_id for o in admitted) == ["a", "b", "c"] and not failed


def test_good_spec_is_pending_then_admitted_by_step(tiny_session):
    s = tiny_session
    out = s.leader.submit(
        "r", {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    )
    assert (out.status, out.cache, out.code, out.seq) == ("pending", "miss", None, 0)
    assert not s.masks.is_running("r")
    with pytest.raises(KeyError):
        s.masks.bitmask(["r"])
    admitted, failed = settle(s)
    assert [(o.request_id, o.seq, o.status) for o in admitted] == [("r", 0, "admitted")]
    assert not failed
    assert s.masks.is_running("r")
    # A later step with nothing pending decides nothing.
    again = s.leader.step(10_000)
    assert again.admitted == [] and again.failed == [] and again.stage_failed == []


def test_compile_failure_is_a_failed_step_outcome_then_poisoned(tiny_session):
    s = tiny_session
    assert s.leader.submit("bad", {"regex": "(a"}).status == "pending"
    admitted, failed = settle(s)
    assert not admitted
    assert [(o.request_id, o.code) for o in failed] == [("bad", "grammar_invalid")]
    assert not s.masks.is_running("bad")
    again = s.leader.submit("bad-again", {"regex": "(a"})
    assert (again.status, again.code, again.cache) == ("failed", "grammar_invalid", "poisoned")


# -- the stale-state contract ------------------------------------------------------


def test_bitmask_twice_without_advance_is_stale(tiny_session):
    s = tiny_session
    admit(s, [("a", {"regex": REGEX}), ("b", {"regex": REGEX})])
    first = s.masks.bitmask(["a"])
    assert allowed(first.rows[0], s.tokenizer.vocab_size) == {ord("a")}
    with pytest.raises(StaleGrammarState, match="advance"):
        s.masks.bitmask(["a"])
    # Another request is independent; a batch holding a stale one is refused
    # whole, and the refused call marks nothing.
    with pytest.raises(StaleGrammarState):
        s.masks.bitmask(["b", "a"])
    s.masks.bitmask(["b"])
    assert not s.masks.advance("a", ids("a"))
    nxt = s.masks.bitmask(["a"])
    assert allowed(nxt.rows[0], s.tokenizer.vocab_size) == {ord("b")}
    s.masks.advance("a", ids("b"))
    s.masks.advance("b", ids("a"))
    s.masks.bitmask(["a", "b"])


def test_advance_that_raises_leaves_state_unchanged(tiny_session):
    s = tiny_session
    admit(s, [("a", {"regex": REGEX})])
    s.masks.bitmask(["a"])
    with pytest.raises(GrammarError) as info:
        s.masks.advance("a", ids("ax"))
    assert info.value.code == ErrorCode.token_rejected
    assert s.masks.state("a").num_tokens == 0
    assert allowed(s.masks.bitmask(["a"]).rows[0], s.tokenizer.vocab_size) == {ord("a")}


def test_release_clears_the_stale_mark(tiny_session):
    s = tiny_session
    admit(s, [("a", {"regex": REGEX})])
    s.masks.bitmask(["a"])
    assert s.leader.release("a") is True
    assert s.leader.release("a") is False
    assert not s.masks.is_running("a")
    with pytest.raises(KeyError):
        s.masks.bitmask(["a"])
    # The id is free again, and the new request is not stale.
    admit(s, [("a", {"regex": "xyz"})])
    assert allowed(s.masks.bitmask(["a"]).rows[0], s.tokenizer.vocab_size) == {ord("x")}


def test_abort_pending_request(tiny_session):
    s = tiny_session
    assert s.leader.submit("p", {"regex": "a"}).status == "pending"
    assert s.leader.release("p") is True
    admitted, failed = settle(s)
    assert not admitted and not failed
    assert not s.masks.is_running("p")
    assert s.leader.submit("p", {"regex": "a"}).status == "pending"


def test_publish_without_workers_is_a_noop(tiny_session):
    s = tiny_session
    admit(s, [("a", {"regex": REGEX})])
    s.masks.publish(0, s.masks.bitmask(["a"]))
    assert s._roles.channel is None and not s.has("reader")


# -- drafts (K = 3) ---------------------------------------------------------------


def test_bitmask_with_drafts_rows_and_counts(spec_session):
    s = spec_session
    v = s.tokenizer.vocab_size
    admit(s, [("r1", {"regex": REGEX}), ("r2", {"regex": REGEX}), ("r3", {"regex": REGEX})])
    batch = s.masks.bitmask(["r1", "r2", "r3"], [ids("abc"), ids("a"), ids("axc")])
    assert isinstance(batch, MaskBatch)
    assert batch.rows.shape == (3 * 4, (v + 31) // 32) and batch.rows.dtype == np.int32
    assert batch.request_ids == ("r1", "r2", "r3")
    assert batch.num_drafts == (3, 1, 3)
    assert batch.failures == {}
    rows = [allowed(r, v) for r in batch.rows]
    everything = set(range(v))
    # r1: before a, after a, after ab, bonus after abc.
    assert rows[0:4] == [{ord("a")}, {ord("b")}, {ord("c"), ord("d")}, {ord("e")}]
    # r2: one draft, then the bonus row; later rows are free.
    assert rows[4:8] == [{ord("a")}, {ord("b")}, everything, everything]
    # r3: the rejected draft 'x' makes its row the bonus row; the rest are free.
    assert rows[8:12] == [{ord("a")}, {ord("b")}, everything, everything]
    # Building moved no state: each accepts its whole text afterwards.
    for rid in ("r1", "r2", "r3"):
        assert s.masks.state(rid).num_tokens == 0
        assert s.masks.advance(rid, [*ids("abdef"), s.tokenizer.stop_ids[0]]) is True


def test_bitmask_without_drafts_under_k3(spec_session):
    s = spec_session
    admit(s, [("r", {"regex": REGEX})])
    batch = s.masks.bitmask(["r"])
    assert batch.rows.shape[0] == 4 and batch.num_drafts == (0,)
    assert allowed(batch.rows[0], s.tokenizer.vocab_size) == {ord("a")}
    assert (batch.rows[1:] == -1).all()


def test_validate_drafts_trims_the_invalid_suffix(spec_session):
    s = spec_session
    admit(s, [("r", {"regex": REGEX})])
    assert s.masks.validate_drafts("r", ids("abx")) == ids("ab")
    assert s.masks.validate_drafts("r", ids("xab")) == []
    assert s.masks.validate_drafts("r", ids("abd")) == ids("abd")
    # Padding ends the drafts.
    assert s.masks.validate_drafts("r", [ord("a"), -1, ord("b")]) == ids("a")
    assert s.masks.state("r").num_tokens == 0
    s.masks.advance("r", ids("ab"))
    assert s.masks.validate_drafts("r", ids("cex")) == ids("ce")
    assert s.masks.state("r").num_tokens == 2


def test_terminated_request_fails_in_the_batch(spec_session):
    s = spec_session
    admit(s, [("r", {"regex": "a"}), ("ok", {"regex": REGEX})])
    stop = s.tokenizer.stop_ids[0]
    assert s.masks.advance("r", [ord("a"), stop]) is True
    batch = s.masks.bitmask(["r", "ok"], [(), ()])
    assert set(batch.failures) == {"r"}
    assert batch.failures["r"].code == ErrorCode.grammar_terminated
    assert (batch.rows[0:4] == -1).all()
    assert allowed(batch.rows[4], s.tokenizer.vocab_size) == {ord("a")}


# -- apply + commit: K > 0 records what K = 0 records --------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "n": {"type": "integer"},
    },
    "required": ["name", "tags", "n"],
}
INSTANCE = '{"name": "gramcoord", "tags": ["x", "yz"], "n": 42}'


def _reference_tokens(tokenizer, compile_json) -> list[int]:
    tokens = [*tokenizer.encode(INSTANCE), tokenizer.eos_id]
    reference = GrammarState(compile_json(tokenizer, SCHEMA))
    reference.accept_tokens(tokens)
    assert reference.is_terminated
    return tokens


def _run_k0(session: RankSession, rid: str, tokens: list[int]) -> int:
    v = session.tokenizer.vocab_size
    steps = 0
    for pos, token in enumerate(tokens):
        batch = session.masks.bitmask([rid])
        logits = torch.zeros(1, v)
        step_digest, rows = session.masks.apply(
            logits, batch.rows, batch=[rid], constrained=[rid], num_drafts={rid: 0}
        )
        assert step_digest == combine(rows[rid]) and len(rows[rid]) == 1
        assert logits[0, token] == 0 and torch.isinf(logits[0]).any()
        session.masks.commit(rid, pos, rows[rid][:1])
        terminated = session.masks.advance(rid, [token])
        assert terminated == (pos == len(tokens) - 1)
        steps += 1
    return steps


def _run_k3(session: RankSession, rid: str, tokens: list[int]) -> tuple[int, int]:
    """Drafts of every kind: right, wrong-but-valid, invalid, none; raw and trimmed."""
    v = session.tokenizer.vocab_size
    stops = frozenset(session.tokenizer.stop_ids)
    space = session.tokenizer.encode(" ")[0]
    eos = session.tokenizer.eos_id
    pos = steps = partial = 0
    terminated = False
    while not terminated:
        right = tokens[pos : pos + 3]
        pattern = steps % 5
        if pattern == 0:
            drafts = right
        elif pattern == 1:
            drafts = [*right[:1], space]
        elif pattern == 2:
            drafts = [eos, *right[1:]]
        elif pattern == 3:
            drafts = []
        else:
            drafts = [*right[:2], space]
        if steps % 2:
            drafts = session.masks.validate_drafts(rid, drafts)
        batch = session.masks.bitmask([rid], [drafts])
        n = 1 + len(drafts)
        assert batch.num_drafts == (len(drafts),)
        logits = torch.zeros(n, v)
        step_digest, rows = session.masks.apply(
            logits, batch.rows, batch=[rid], constrained=[rid], num_drafts={rid: len(drafts)}
        )
        assert len(rows[rid]) == n and step_digest == combine(rows[rid])
        picks = [tokens[min(pos + i, len(tokens) - 1)] for i in range(n)]
        acc = accepted_tokens(picks, drafts, stops, room=len(tokens))
        assert acc == tokens[pos : pos + len(acc)]
        for i in range(len(acc)):
            assert logits[i, acc[i]] == 0  # the row that picked it allowed it
        partial += len(acc) < n
        session.masks.commit(rid, pos, rows[rid][: len(acc)])
        terminated = session.masks.advance(rid, acc)
        pos += len(acc)
        steps += 1
    assert pos == len(tokens)
    return steps, partial


def test_committed_draft_rows_match_the_k0_digests(qwen_tokenizer, compile_json):
    tokens = _reference_tokens(qwen_tokenizer, compile_json)
    spec = {"json": SCHEMA}
    s0 = local_session(qwen_tokenizer, k=0)
    s3 = local_session(qwen_tokenizer, k=3)
    try:
        admit(s0, [("req", spec)])
        admit(s3, [("req", spec)])
        k0_steps = _run_k0(s0, "req", tokens)
        k3_steps, partial = _run_k3(s3, "req", tokens)
        d0 = MaskDigests.index(s0.masks.digests.records())
        d3 = MaskDigests.index(s3.masks.digests.records())
    finally:
        s0.close()
        s3.close()
    assert set(d0) == {("req", p) for p in range(len(tokens))}
    assert d3 == d0
    assert len(set(d0.values())) > 3  # the rows really differ along the output
    assert not s0.masks.digests.self_mismatches and not s3.masks.digests.self_mismatches
    assert k3_steps < k0_steps and partial > 0
    assert s3.stats.rows_applied > s3.stats.masks_built == k3_steps


def test_digest_record_keeps_the_first_and_counts_a_self_mismatch():
    digests = MaskDigests()
    row = np.full((1, 4), -1, dtype=np.int32)
    d = row_digest(row[0])
    digests.record("r", 3, d)
    digests.record("r", 3, d)
    assert not digests.self_mismatches
    digests.record("r", 3, d ^ 1)
    assert digests.self_mismatches == [("r", 3)]
    assert MaskDigests.index(digests.records()) == {("r", 3): d}
    assert row_digest(row[0]) != row_digest(np.zeros(4, dtype=np.int32))


# -- stats ---------------------------------------------------------------------


def test_stats_is_a_typed_struct_with_manager_counters(tiny_session):
    s = tiny_session
    assert s.leader.submit("a1", {"regex": "[ab]+"}).cache == "miss"
    assert s.leader.submit("a2", {"regex": "[ab]+"}).cache == "joined"
    settle(s)
    assert s.leader.submit("a3", {"regex": "[ab]+"}).cache == "hit"
    s.leader.submit("bad", {"regex": "(b"})
    settle(s)
    assert s.leader.submit("bad2", {"regex": "(b"}).cache == "poisoned"
    s.leader.submit("invalid", {"regex": ""})
    s.masks.bitmask(["a1", "a2"])
    stats = s.stats
    assert isinstance(stats, SessionStats)
    assert isinstance(stats.manager, ManagerStats)
    m = stats.manager
    assert (m.miss, m.joined, m.hit, m.poisoned) == (2, 1, 1, 1)
    assert (m.admitted, m.failed, m.invalid_spec) == (3, 1, 1)
    assert stats.masks_built == 1 and stats.rows_applied == 0
    assert stats.jump_forward is None and stats.transport_dropped == 0
    # Plain typed data: it survives an encode / decode round trip.
    again = msgspec.json.decode(msgspec.json.encode(stats), type=SessionStats)
    assert again == stats


def test_stats_with_jump_forward(tiny_tokenizer):
    s = local_session(tiny_tokenizer, jump_forward=True)
    try:
        admit(s, [("r", {"regex": "abc(d|e)"})])
        out: list[int] = []
        result = s.masks.jump_forward("r", out)
        assert result is not None and out == ids("abc")
        assert isinstance(s.stats.jump_forward, JumpStats)
    finally:
        s.close()
    assert s.stats.manager is None  # closed


# -- the TP reader path ---------------------------------------------------------


def test_tp_reader_applies_what_the_leader_applied(tiny_tokenizer, run_id):
    v = tiny_tokenizer.vocab_size
    config = session_config(3)
    leader = RankSession.local(tiny_tokenizer, config)
    worker = RankSession.local(tiny_tokenizer, config)
    reader = None
    try:
        channel = BitmaskChannel(
            readers=["rank1"],
            vocab_size=v,
            max_rows=config.scheduler.max_num_seqs * 4,
            config=TransportConfig(num_slots=2, timeout_s=5.0, handshake_timeout_s=5.0),
            run_id=run_id,
            label="dp0",
        )
        # What build_roles does for tp > 1.
        leader._roles.channel = leader.masks._channel = channel
        with ThreadPoolExecutor(1) as pool:
            joining = pool.submit(
                MaskReader.connect,
                channel.handle,
                "rank1",
                vocab_size=v,
                applier=MaskApplier((v + 31) // 32, max_num_seqs=8, num_speculative_tokens=3),
                stats=SessionStats(),
            )
            channel.accept(timeout=10)
            reader = joining.result(timeout=10)
        admit(leader, [("r1", {"regex": REGEX}), ("r2", {"regex": "[a-f]+x"})])
        stop = tiny_tokenizer.stop_ids[0]
        texts = {"r1": [*ids("abdef"), stop], "r2": [*ids("fcdax"), stop]}
        out = {"r1": [], "r2": []}
        live = ["r1", "r2"]
        gen = torch.Generator().manual_seed(0)
        terminated = {}
        for step in range(3):  # 0, 1, then 2 drafts: 1 + 2 + 3 tokens each
            drafts = {r: texts[r][len(out[r]) : len(out[r]) + step] for r in live}
            drafts = {r: leader.masks.validate_drafts(r, d) for r, d in drafts.items()}
            batch = leader.masks.bitmask(live, [drafts[r] for r in live])
            leader.masks.publish(step, batch)
            got = reader.receive(step, timeout=10)
            assert got.request_ids == batch.request_ids
            assert got.num_drafts == batch.num_drafts
            np.testing.assert_array_equal(got.rows, batch.rows)
            assert not got.rows.flags.writeable
            # An unconstrained request sits first in the batch on both sides.
            order = ["free", *live]
            num_drafts = {"free": 1, **{r: len(drafts[r]) for r in live}}
            n = sum(1 + d for d in num_drafts.values())
            lead_logits = torch.randn(n, v, generator=gen)
            work_logits = lead_logits.clone()
            mine = leader.masks.apply(
                lead_logits, batch.rows, batch=order, constrained=live, num_drafts=num_drafts
            )
            theirs = worker.masks.apply(
                work_logits, got.rows, batch=order, constrained=live, num_drafts=num_drafts
            )
            reader.release(step)
            assert mine == theirs
            assert torch.equal(lead_logits, work_logits)
            assert torch.isfinite(lead_logits[:2]).all()  # the free request's rows
            for r in live:  # accept what the drafts got right, plus the bonus
                acc = texts[r][len(out[r]) : len(out[r]) + len(drafts[r]) + 1]
                terminated[r] = leader.masks.advance(r, acc)
                out[r] += acc
        assert out == texts and all(terminated.values())
        assert leader.stats.transport_dropped == 0 and reader.dropped == 0
        assert leader.stats.rows_applied == worker.stats.rows_applied > 0
    finally:
        if reader is not None:
            reader.close()
        leader.close()  # closes the channel too
        worker.close()
    assert leader._roles.channel is None


def test_request_state_follows_the_lifecycle(tiny_tokenizer):
    from gramcoord.rank_worker.config import GrammarConfig, SchedulerConfig
    from gramcoord.rank_worker.session.session import SessionConfig

    config = SessionConfig(
        grammar=GrammarConfig(max_pending=1, compile_mode="sync"),
        scheduler=SchedulerConfig(max_num_seqs=4),
    )
    session = RankSession.local(tiny_tokenizer, config)
    try:
        assert session.leader.submit("a", {"regex": "[a-z]+"}).status == "pending"
        assert session.leader.submit("b", {"regex": "[0-9]+"}).status == "waiting"
        assert session.leader.request_state("a") == "pending"
        assert session.leader.request_state("b") == "waiting"
        assert session.leader.request_state("nope") == "unknown"
        admitted = session.leader.step(0).admitted
        assert [o.request_id for o in admitted] == ["a"]
        assert session.leader.request_state("a") == "running"
        assert session.leader.request_state("b") == "pending"
        session.leader.release("a")
        assert session.leader.request_state("a") == "unknown"
        assert session.leader.release("b") and session.leader.request_state("b") == "unknown"
    finally:
        session.close()


def test_bitmask_copy_outlives_the_next_build(tiny_tokenizer):
    from gramcoord.rank_worker.config import GrammarConfig
    from gramcoord.rank_worker.session.session import SessionConfig

    session = RankSession.local(
        tiny_tokenizer, SessionConfig(grammar=GrammarConfig(compile_mode="sync"))
    )
    try:
        session.leader.submit("a", {"regex": "ab"})
        session.leader.step(0)
        kept = session.masks.bitmask(["a"], copy=True)
        first = kept.rows.copy()
        session.masks.advance("a", [ord("a")])
        session.masks.bitmask(["a"])  # overwrites the builder's buffer
        assert (kept.rows == first).all()
    finally:
        session.close()


def test_host_vocabulary_from_tokenizer_info(tiny_tokenizer):
    from gramcoord.rank_worker.grammars.tokenizer import Tokenizer, TokenizerError

    host = Tokenizer.from_info(tiny_tokenizer.info, "host-vocab", vocab_size=288)
    assert host.vocab_size == 288 and host.stop_ids == tiny_tokenizer.stop_ids
    assert not host.can_encode
    assert host.fingerprint() != Tokenizer.from_info(tiny_tokenizer.info, "other").fingerprint()
    assert (
        host.fingerprint()
        == Tokenizer.from_info(tiny_tokenizer.info, "host-vocab", vocab_size=288).fingerprint()
    )
    with pytest.raises(TokenizerError):
        host.encode("x")
    with pytest.raises(TokenizerError):
        Tokenizer.from_info(tiny_tokenizer.info, "")
    session = RankSession.local(host)
    try:
        assert session.leader.submit("a", {"regex": "[a-z]+"}).status == "pending"
        while not session.leader.step(0).admitted:
            pass
        rows = session.masks.bitmask(["a"]).rows
        assert rows.shape == (1, (288 + 31) // 32)
    finally:
        session.close()


def test_digests_truncate_forgets_replaced_positions():
    d = MaskDigests()
    for pos in range(5):
        d.record("a", pos, pos + 100)
    d.record("b", 3, 7)
    d.truncate("a", 3)
    assert sorted((r.request_id, r.position) for r in d.records()) == [
        ("a", 0),
        ("a", 1),
        ("a", 2),
        ("b", 3),
    ]
    d.record("a", 3, 999)  # re-masked from new tokens: not a self-mismatch
    assert not d.self_mismatches


def test_a_role_the_rank_does_not_hold_is_a_named_error(tiny_session):
    s = tiny_session
    assert s.has("leader") and s.has("masks")
    assert not s.has("reader") and not s.has("follower") and not s.has("manager")
    with pytest.raises(RoleError, match=r"has no 'reader' role; its roles: leader, masks"):
        s.reader.receive(0)
    with pytest.raises(RoleError, match=r"\(dp 0, pp 0, tp 0\) has no 'follower' role"):
        s.follower.step(0)
