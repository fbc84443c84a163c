"""The vLLM-shaped adapter (``rank_worker/integrations/vllm_backend.py``) in a fake vLLM engine.

``tests/integrations/fake_vllm.py`` replays vLLM V1's step order (schedule
with ``manager.update`` first, forward on a thread, ``grammar_bitmask``
meanwhile, compact rows applied with spec-decode offsets, tokens accepted,
drafts validated). Which test reproduces which vLLM issue:

- vllm#29996 (async grammar compile deadlocks the external launcher; vLLM's
  fix forces sync compile): ``test_without_agreement_batches_diverge``
  shows the cause (two ranks that decide readiness alone under skewed
  compile latency schedule different batches; with a collective in the
  forward they would hang), and ``test_dp_identical_batches_with_async_compile``
  runs two external-launcher-style ranks (one scheduler each, the same
  stream) with async compile on and skewed latency: every step's batch,
  drafts included, is identical.
- vllm#45012 / #47312 (a compile failure leaves its request hanging or
  crashes the engine): ``test_dp_failures_finish_on_the_same_step`` (a
  schema xgrammar refuses, a compile that times out on one rank only, a
  spec rejected at once: each finishes with its code on the same step on
  both ranks, the other requests' outputs equal the one-process reference)
  and ``test_failed_compile_resolves_the_grammar_slot``.
- vllm#45015 ("Failed to advance FSM": grammar state stale under async
  scheduling or PP): ``test_stale_state_is_a_named_error``.
- vllm#14151 / #54003 (a compile with no timeout burns CPU for hours):
  ``test_compile_hang_is_bounded_by_compile_timeout`` (and the timeout in
  the dp test).
- Pipeline parallelism: ``test_pp2_chain`` (stage 0 schedules, stage 1
  follows the decision through the session's step, builds the masks and
  accepts the tokens; a stage-1 compile timeout reaches stage 0 the same
  step).
"""

from __future__ import annotations

import enum
import time

import numpy as np
import pytest
import torch

from gramcoord.rank_worker.integrations.vllm_backend import (
    GramcoordBackend,
    GramcoordGrammar,
    GrammarInitError,
    GrammarNotReady,
    StaleGrammarState,
    StructuredOutputOptions,
    StructuredOutputRequest,
    spec_from_key,
    structured_output_key,
)
from gramcoord.rank_worker.integrations.vllm_manager import GramcoordStructuredOutputManager
from gramcoord.rank_worker.session.session import RankSession
from tests.integrations import fake_vllm as fv
from tests.procs import free_port, run_procs

GOOD = [
    "jsonschemabench/Github_trivial/o32735",
    "jsonschemabench-regex/8f7df4826628d70d",
    "gramcoord/choice/sentiment",
    "gramcoord/ebnf/weather",
    "gramcoord/json_object/status",
    "gramcoord/plain/greeting",
    "bfcl/BFCL_simple/BFCL_simple_313",
    "jsonschemabench/WashingtonPost/wp_108_Normalized",
]
HANG = {
    "id": "hang/regex",
    "prompt": "A ticket code:",
    "max_tokens": 16,
    "structured_outputs": {"regex": "[a-z]{3}-hang-[0-9]{2}"},
}
MAX_TOKENS = 48


class _VllmOptions(enum.Enum):
    """Stands in for vLLM's own enum: matched by member name."""

    JSON = enum.auto()
    CHOICE = enum.auto()


def _local(tokenizer, *, k=0, **grammar) -> RankSession:
    return RankSession.local(tokenizer, fv.session_config(k=k, **grammar))


def _request(rid: str, params: dict | None) -> fv.FakeRequest:
    return fv.FakeRequest(rid, [], 16, None, params, StructuredOutputRequest.from_params(params))


def _settle(manager: GramcoordStructuredOutputManager, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while manager.session.manager.num_pending or manager.session.manager.num_waiting:
        manager.update()
        assert time.monotonic() < deadline, "compiles never settled"
        time.sleep(0.005)


# -- keys and specs ------------------------------------------------------------------


def test_structured_output_key_and_spec_follow_vllm_names():
    schema = {"type": "object"}
    assert structured_output_key({"json": schema}) == (
        StructuredOutputOptions.JSON,
        '{"type": "object"}',
    )
    assert structured_output_key({"json_object": True}) == (StructuredOutputOptions.JSON_OBJECT, "")
    assert structured_output_key({"choice": ["a", "b"]})[1] == '["a", "b"]'
    assert structured_output_key({"regex": "x+"}) == (StructuredOutputOptions.REGEX, "x+")
    assert structured_output_key({"grammar": "root ::= 'a'"})[0] is StructuredOutputOptions.GRAMMAR
    with pytest.raises(ValueError, match="none of"):
        structured_output_key({"disable_any_whitespace": True})
    assert spec_from_key(_VllmOptions.JSON, "{}") == {"json": "{}"}
    assert spec_from_key(_VllmOptions.CHOICE, '["x"]') == {"choice": ["x"]}
    assert spec_from_key("json_object", "") == {"json_object": True}
    assert spec_from_key("STRUCTURAL_TAG", "{}") == {"structural_tag": "{}"}
    assert spec_from_key("nonsense", "x") == {}


def test_backend_compile_never_raises_and_allocates_vllm_shaped_masks(tiny_tokenizer):
    session = _local(tiny_tokenizer, compile_mode="sync")
    backend = GramcoordBackend(session)
    try:
        bad = backend.compile_grammar(_VllmOptions.CHOICE, "not json")
        assert bad.outcome.status == "failed" and bad.outcome.code == "spec_bad_type"
        unknown = backend.compile_grammar("nonsense", "x")
        assert unknown.outcome.code == "spec_no_kind"
        good = backend.compile_grammar(StructuredOutputOptions.REGEX, "[ab]+")
        assert good.outcome.status == "pending" and good.request_id.startswith("grammar-")
        mask = backend.allocate_token_bitmask(3)
        assert mask.dtype == torch.int32
        assert tuple(mask.shape) == (3, (tiny_tokenizer.vocab_size + 31) // 32)
        assert bool((mask == -1).all())
    finally:
        backend.destroy()
    assert session.manager is None  # destroy closed the session it owns


# -- the grammar object ---------------------------------------------------------------


def test_grammar_methods_follow_the_session(qwen_tokenizer):
    tok = qwen_tokenizer
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}},
        "required": ["name"],
    }
    session = _local(tok, compile_mode="sync", any_whitespace=False)
    manager = GramcoordStructuredOutputManager(session)
    req = _request("r1", {"json": schema})
    try:
        assert manager.grammar_init(req).status == "pending"
        sor = req.structured_output_request
        assert not sor.is_grammar_ready and sor.grammar is None
        early = manager.grammar("r1")
        with pytest.raises(GrammarNotReady, match="only a step decision admits it"):
            early.fill_bitmask(np.zeros((1, 8), np.int32), 0)
        decided = manager.update(1)
        assert [o.request_id for o in decided.admitted] == ["r1"]
        grammar = sor.grammar
        assert isinstance(grammar, GramcoordGrammar) and grammar is early and grammar.is_ready

        jump = grammar.find_jump_string()
        assert jump is not None and jump.startswith('{"name":')
        text = tok.encode('{"name": "Bob"}')
        whole = [*text, tok.eos_id]
        assert grammar.validate_tokens(whole) == whole
        assert grammar.validate_tokens([*tok.encode("[1]")]) == []

        rows = session.bitmask(["r1"]).rows.copy()  # reference row (marks r1 masked)
        as_torch = GramcoordBackend(session, owns_session=False).allocate_token_bitmask(2)
        grammar.fill_bitmask(as_torch, 1)
        as_numpy = np.zeros((1, rows.shape[1]), np.int32)
        grammar.fill_bitmask(as_numpy, 0)
        assert (as_torch[1].numpy() == rows[0]).all() and (as_numpy[0] == rows[0]).all()

        assert grammar.accept_tokens("r1", text[:2])
        grammar.rollback(2)
        assert grammar.find_jump_string() == jump
        with pytest.raises(ValueError, match="asked to accept"):
            grammar.accept_tokens("other", text[:1])
        assert not grammar.accept_tokens("r1", tok.encode("[1]"))
        assert grammar.error.code.name == "token_rejected"

        assert grammar.accept_tokens("r1", whole)
        assert grammar.is_terminated() and grammar.find_jump_string() is None
        grammar.fill_bitmask(as_numpy, 0)
        assert (as_numpy[0] == -1).all()  # terminated: a full row, as in vLLM
        grammar.reset()
        assert not grammar.is_terminated() and grammar.find_jump_string() == jump
    finally:
        manager.clear_backend()


def test_grammar_bitmask_compact_rows_match_vllms_serial_fill(qwen_tokenizer):
    """Rows per request = 1 + its drafts, each the mask after the drafts before it."""
    tok = qwen_tokenizer
    session = _local(tok, k=2, compile_mode="sync", any_whitespace=False)
    manager = GramcoordStructuredOutputManager(session)
    specs = {
        "a": {"json": {"type": "object", "properties": {"n": {"type": "integer"}}}},
        "b": {"regex": "[a-z]+-[0-9]+"},
        "c": {"choice": ["yes", "no"]},
    }
    reqs = {rid: _request(rid, p) for rid, p in specs.items()}
    try:
        for r in reqs.values():
            manager.grammar_init(r)
        manager.update(1)
        drafts = {"a": tok.encode('{"n"'), "b": [], "c": tok.encode("y")[:1]}
        drafts["a"] = drafts["a"][:2]
        ids = ["a", "b", "c"]
        rows = manager.grammar_bitmask(reqs, ids, drafts)
        assert rows.dtype == np.int32
        assert rows.shape == (3 + 1 + 2, (tok.vocab_size + 31) // 32)
        # vLLM's serial path with the grammar's own methods: fill, accept the
        # draft, next row; then roll back what was accepted.
        expected = np.zeros_like(rows)
        index = 0
        for rid in ids:
            grammar = reqs[rid].structured_output_request.grammar
            advanced = 0
            for token in [*drafts[rid], None]:
                grammar.fill_bitmask(expected, index)
                if token is not None:
                    assert grammar.accept_tokens(rid, [token])
                    advanced += 1
                index += 1
            grammar.rollback(advanced)
        assert (rows == expected).all()
        assert manager.grammar_bitmask(reqs, [], {}) is None
        # This step's output (nothing kept) reaches every grammar before the
        # next build; "b" was masked without drafts and would be stale.
        for rid in ids:
            assert reqs[rid].structured_output_request.grammar.accept_tokens(rid, [])
        # Every request with K drafts: gramcoord's fixed layout, as is.
        full = {rid: (tok.encode('{"n')[:2] if rid == "a" else [-1, -1]) for rid in ids}
        assert manager.grammar_bitmask(reqs, ids, full).shape[0] == 3 * 3
    finally:
        manager.clear_backend()


def test_failed_compile_resolves_the_grammar_slot(tiny_tokenizer):
    """vllm#45012: a failure is the request's error, never a hang or a crash."""
    session = _local(tiny_tokenizer, compile_mode="async")
    manager = GramcoordStructuredOutputManager(session)
    refused = _request("refused", {"regex": "(?=a)b"})  # a lookahead xgrammar refuses
    empty = _request("empty", {"choice": []})
    aborted = _request("aborted", {"regex": "[0-9]+"})
    try:
        assert manager.grammar_init(refused).status == "pending"
        # Rejected at the boundary: decided at once, identically on every rank.
        assert manager.grammar_init(empty).status == "failed"
        slot = empty.structured_output_request
        assert slot.is_grammar_ready and slot.grammar.code == "spec_empty_choice"
        manager.grammar_init(aborted)
        assert manager.abort_request("aborted")
        assert aborted.structured_output_request.grammar.code == "aborted"
        _settle(manager)
        failed = refused.structured_output_request.grammar
        assert isinstance(failed, GrammarInitError)
        assert failed.code == "grammar_invalid" and failed.request_id == "refused"
        assert manager.grammar("refused") is None
    finally:
        manager.clear_backend()


# -- the fake engine, one process -------------------------------------------------------


def test_stale_state_is_a_named_error(qwen_tokenizer):
    """vllm#45015: masking a request whose last tokens were never accepted raises."""
    tok = qwen_tokenizer
    session = _local(tok, compile_mode="sync")
    core = fv.build_core(session, tok, k=0, max_num_seqs=4)
    rid = GOOD[0]
    try:
        for req in fv.make_requests(tok, [rid, GOOD[3]], max_tokens=MAX_TOKENS):
            core.scheduler.add_request(req)
        # Step 3's output of rid is lost before accept_tokens (as when an
        # async or pipelined scheduler drops an output).
        core.scheduler.drop_accept = {(3, rid)}
        for _ in range(3):
            assert core.step()
        with pytest.raises(StaleGrammarState, match="never advanced") as info:
            core.step()
        assert rid in str(info.value) and core.scheduler.step == 4
    finally:
        core.runner.close()
        core.scheduler.manager.clear_backend()


def test_compile_hang_is_bounded_by_compile_timeout(qwen_tokenizer):
    """vllm#14151 / #54003: a compile that never ends fails its request in time."""
    tok = qwen_tokenizer
    timeout_s, hang_s = 0.5, 6.0
    session = _local(tok, compile_mode="async", compile_timeout_s=timeout_s)
    skewed = fv.skew_compiles(session, fv.delay_table({"-hang-": hang_s}, 0.0))
    core = fv.build_core(session, tok, k=0, max_num_seqs=8)
    requests = fv.make_requests(tok, GOOD[:2], extra=[HANG], max_tokens=MAX_TOKENS)
    t0 = time.perf_counter()
    try:
        fv.run_engine(core, requests, per_step=3)
        wall = time.perf_counter() - t0
        stuck = session.manager.service.num_stuck()
    finally:
        skewed.stop.set()
        core.runner.close()
        core.scheduler.manager.clear_backend()
    out = fv.outputs_of(core.scheduler)
    assert out["hang/regex"]["reason"] == "error"
    assert out["hang/regex"]["code"] == "grammar_timeout"
    assert all(out[r]["code"] is None for r in GOOD[:2])
    assert wall < hang_s / 2, f"the run waited for the hung compile ({wall:.1f}s)"
    assert stuck == 1  # the thread is still in its compile, counted as stuck


def test_without_agreement_batches_diverge(qwen_tokenizer):
    """vllm#29996's cause: ranks that decide readiness alone schedule differently."""
    tok = qwen_tokenizer
    cores = []
    skews = []
    for delay in (0.0, 0.3):
        session = _local(tok, compile_mode="async")
        skews.append(fv.skew_compiles(session, fv.delay_table({}, delay)))
        cores.append(fv.build_core(session, tok, k=0, max_num_seqs=8))
    queues = [fv.make_requests(tok, GOOD[:3], max_tokens=8) for _ in cores]
    try:
        for _ in range(2000):
            for core, queue in zip(cores, queues):
                for req in queue[:2]:
                    core.scheduler.add_request(req)
                del queue[:2]
            if not any(q or c.scheduler.has_unfinished_requests() for c, q in zip(cores, queues)):
                break
            ran = [c.step() for c in cores]
            if not all(ran):
                time.sleep(fv.IDLE_S)
    finally:
        for s in skews:
            s.stop.set()
        for c in cores:
            c.runner.close()
            c.scheduler.manager.clear_backend()
    logs = [[(r.step, r.admitted, r.batch) for r in c.scheduler.log] for c in cores]
    assert logs[0] != logs[1]
    first = [next(r.step for r in c.scheduler.log if r.admitted) for c in cores]
    assert first[0] < first[1], first
    # Same tokens in the end: only the steps differ, which is what deadlocks
    # collectives in a real forward.
    outs = [{k: v["tokens"] for k, v in fv.outputs_of(c.scheduler).items()} for c in cores]
    assert outs[0] == outs[1]


# -- multi-process ------------------------------------------------------------------------


def _spawn(target, job: dict) -> list[dict]:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    return [r.value for r in run_procs(target, 2, args=(job,), timeout=180, env=env)]


DP_JOB = dict(
    ids=[*GOOD, "bad/compile-error-1", "bad/empty-choice"],
    extra=[HANG],
    k=2,
    max_tokens=MAX_TOKENS,
    per_step=2,
    compile_timeout_s=1.0,
    # Rank 1 compiles every grammar 0.25 s later than rank 0, and hangs on
    # the "-hang-" regex (rank 0 compiles it at once).
    base_delay={0: 0.0, 1: 0.25},
    delays={0: {}, 1: {"-hang-": 8.0}},
)


@pytest.fixture(scope="module")
def dp_run():
    t0 = time.perf_counter()
    results = _spawn(fv.dp_rank, DP_JOB)
    return results, time.perf_counter() - t0


@pytest.fixture(scope="module")
def reference(qwen_tokenizer):
    return fv.run_local(qwen_tokenizer, GOOD, k=0, max_tokens=MAX_TOKENS)


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_dp_identical_batches_with_async_compile(dp_run):
    """vllm#29996: one scheduler per rank, async compile, skewed latency."""
    (r0, r1), _wall = dp_run
    assert r0["steps"] == r1["steps"]
    for a, b in zip(r0["log"], r1["log"], strict=True):
        assert a == b, f"rank 0 and rank 1 scheduled differently at step {a[0]}:\n{a}\n{b}"
    assert r0["digests"] == r1["digests"] and r0["digests"]
    assert r0["outputs"] == r1["outputs"]
    # Drafts were scheduled (rows with spec-decode offsets were applied).
    assert any(drafts for _, _, _, batch in r0["log"] for _, drafts in batch)
    # ready = intersection: no rank admits a request before its own compile
    # returned, and rank 0 (fast) held its requests back for rank 1 (slow).
    admitted_at = {rid: step for step, admitted, _, _ in r0["log"] for rid in admitted}
    for r in (r0, r1):
        assert set(r["ready_steps"]) >= set(admitted_at)
        for rid, step in admitted_at.items():
            assert step >= r["ready_steps"][rid], (r["rank"], rid, step, r["ready_steps"][rid])
    held = [rid for rid, step in admitted_at.items() if step > r0["ready_steps"][rid]]
    assert len(held) >= len(admitted_at) // 2, (admitted_at, r0["ready_steps"])


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_dp_failures_finish_on_the_same_step(dp_run, reference):
    """vllm#45012: compile error, one-rank timeout, bad spec: same step, others unaffected."""
    (r0, r1), _wall = dp_run
    out0, out1 = r0["outputs"], r1["outputs"]
    expected = {
        "bad/compile-error-1": "grammar_invalid",
        "hang/regex": "grammar_timeout",
        "bad/empty-choice": "spec_empty_choice",
    }
    for rid, code in expected.items():
        assert out0[rid]["reason"] == out1[rid]["reason"] == "error"
        assert out0[rid]["code"] == out1[rid]["code"] == code, (rid, out0[rid], out1[rid])
        assert out0[rid]["step"] == out1[rid]["step"] > 0
        failed_at = [step for step, _, failed, _ in r0["log"] if rid in dict(failed)]
        assert failed_at == [out0[rid]["step"]]
    for rid in GOOD:
        for out in (out0, out1):
            assert out[rid]["code"] is None
            assert out[rid]["tokens"] == reference[rid]["tokens"], rid
            assert out[rid]["reason"] == reference[rid]["reason"], rid


PP_JOB = dict(
    ids=[GOOD[0], GOOD[1], GOOD[2], GOOD[5], GOOD[6], "bad/compile-error-1"],
    extra=[HANG],
    per_step=2,
    compile_timeout_s=1.0,
    # Stage 1 compiles 0.1 s later than stage 0 (it waits for its own
    # compile when the decision arrives), and hangs on the "-hang-" regex.
    base_delay={0: 0.0, 1: 0.1},
    delays={0: {}, 1: {"-hang-": 8.0}},
)


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_pp2_chain(reference):
    """dp=1 pp=2: stage 0 schedules; stage 1 follows its decision and builds the masks."""
    s0, s1 = _spawn(fv.pp_rank, PP_JOB)
    assert s0["builder"] is False and s1["masked_rows"] > 0 and s1["digests"]
    out = s0["outputs"]
    for rid in PP_JOB["ids"][:-1]:
        assert out[rid]["code"] is None, (rid, out[rid])
        assert out[rid]["tokens"] == reference[rid]["tokens"], rid
    assert out["bad/compile-error-1"]["code"] == "grammar_invalid"
    # Admitted by stage 0, not compiled on stage 1 in time: stage 1's
    # failure reaches stage 0, which finishes the request that very step.
    hang = out["hang/regex"]
    assert hang["code"] in ("grammar_stage_timeout", "grammar_timeout"), hang
    # Stage 1 applied stage 0's decisions, step for step: what stage 0
    # admitted, stage 1 admitted too or failed on its own (stage timeout);
    # what stage 0 failed, stage 1 failed.
    log0 = {step: (set(adm), {r for r, _ in f}) for step, adm, f, _ in s0["log"]}
    log1 = {step: (set(adm), {r for r, _ in f}) for step, adm, f in s1["decided"]}
    assert set(log0) == set(log1)
    stage_failed = {}
    for step, (adm0, failed0) in log0.items():
        adm1, failed1 = log1[step]
        stage_failed[step] = failed1 - failed0
        assert adm0 == adm1 | stage_failed[step], step
        assert failed0 <= failed1, step
    hang_step = next(s for s, ids in stage_failed.items() if "hang/regex" in ids)
    assert hang["step"] == hang_step
