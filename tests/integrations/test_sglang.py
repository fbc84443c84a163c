"""The SGLang drop-in (``rank_worker/integrations/sglang_manager.py``, ``sglang_grammar.py``) under a fake SGLang scheduler.

``tests/integrations/fake_sglang.py`` runs SGLang's event-loop shape around
``SGLangGrammarManager``; ``sglang_ranks.py`` holds the spawned rank bodies
(real Qwen2.5 vocabulary, small workloads from ``configs/workload.jsonl``,
at most 48 new tokens). What each multi-rank test reproduces upstream:

- ``test_replicated_dp_admits_in_lockstep_under_compile_skew``: schedulers
  of one request stream whose compiles finish at different times. SGLang
  syncs pickled sets of grammar-queue indices (sglang#17100 for the
  intersection / union); here each request is admitted at the same
  iteration everywhere and outputs are identical.
- ``test_partitioned_dp_shares_poisoned_schema``: DP-attention replicas with
  their own streams; SGLang caches a failed grammar on its own rank only
  (and a timeout for ever). A schema that fails on rank 1 is refused on
  rank 0 without compiling.
- ``test_pp_stages_schedule_the_same_batches``: sglang#28424 (PP stages
  decide readiness apart and schedule different batches), fixed upstream by
  sglang#30747; compiles are skewed both ways between the stages.
- ``test_idle_rank_still_steps`` and ``test_guarded_get_ready_ends_at_the_deadline``:
  sglang#3600 (an all_reduce hangs when one rank alone reaches the grammar
  sync): called every iteration, a rank with no grammar request keeps its
  peers going; called under SGLang's ``has_waiting_grammars()`` guard, the
  ranks end with ``PeerLostError`` at the deadline instead of hanging.

The single-process tests cover the grammar objects: ``copy`` (SGLang's
grammar cache) and ``rollback``, masks, aborts and jump-forward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.grammars.spec import validate_spec
from gramcoord.rank_worker.integrations.sglang_grammar import (
    ANY_JSON,
    StageMismatch,
    TokenRejected,
    spec_from_sampling_params,
)
from gramcoord.rank_worker.integrations.sglang_manager import SGLangGrammarManager
from gramcoord.rank_worker.session import RankSession, SessionConfig, StaleGrammarState
from tests.integrations.fake_sglang import (
    FakeScheduler,
    Req,
    SamplingParams,
    load_records,
    to_req,
)
from tests.procs import free_port, run_procs, run_ranks

GOOD = [
    "jsonschemabench/Github_trivial/o27031",
    "json-schema-test-suite/draft2020-12/optional/bignum#3",
    "bfcl/BFCL_simple/BFCL_simple_313",
    "jsonschemabench-regex/8f7df4826628d70d",
    "gramcoord/choice/sentiment",
    "gramcoord/ebnf/datetime",
    "gramcoord/json_object/status",
]
PLAIN = ["gramcoord/plain/greeting", "gramcoord/plain/haiku"]
JSON = {GOOD[0], GOOD[1], GOOD[2], GOOD[6]}
BAD_COMPILE = "bad/compile-error-1"  # validates, xgrammar refuses it: grammar_invalid
BAD_SPEC = "bad/unique-items"  # refused at arrival: schema_unsupported_feature
COMPILE_DELAY_S = 0.25
RANKS = "tests.integrations.sglang_ranks"


def _wave(ids, suffix=""):
    return [(rid + suffix, rid) for rid in ids]


def _start(parallel, plan, *, delay_s=0.0):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    results = run_procs(f"{RANKS}:started", 2, args=(parallel, plan, delay_s), timeout=200, env=env)
    return [r.value for r in results]


def _attach(parallel, plan, *, step_timeout_s=30.0, guard=False, check=True):
    results = run_ranks(
        f"{RANKS}:attached",
        2,
        args=(parallel, plan, 0.0, step_timeout_s, guard),
        timeout=200,
        check=check,
    )
    return results if not check else [r.value for r in results]


def _summary(report):
    """Per request: finish, error code, tokens, and the iterations it was admitted and ended."""
    return {
        rid: (
            o.finish_reason,
            o.error.split(":", 1)[0] if o.error else None,
            o.token_ids,
            o.admitted_at,
            o.finished_at,
        )
        for rid, o in report.outputs.items()
    }


def _assert_finished_well(report, ids):
    for rid in ids:
        o = report.outputs[rid]
        assert o.error is None and o.finish_reason in ("grammar_end", "length"), o
        assert o.token_ids, o
        if o.finish_reason == "grammar_end" and rid.removeprefix("again/") in JSON:
            json.loads(o.text)


# -- multi-rank ------------------------------------------------------------------


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_replicated_dp_admits_in_lockstep_under_compile_skew():
    waves = {0: _wave([*GOOD[:4], BAD_COMPILE, BAD_SPEC, PLAIN[0]]), 2: _wave(GOOD[4:])}
    # The same stream on both replicas; a repeated spec joins the cache.
    waves[3] = [("again/" + GOOD[0], GOOD[0])]
    r0, r1 = _start({"dp": 2, "requests": "replicated"}, {0: waves, 1: waves}, delay_s=0.25)

    assert r0.iterations == r1.iterations
    assert _summary(r0) == _summary(r1)
    _assert_finished_well(r0, [*GOOD, "again/" + GOOD[0]])
    # Every constrained request waited for a compile that was slow on one rank.
    assert min(r0.outputs[rid].admitted_at for rid in GOOD) >= 1
    assert r0.outputs["again/" + GOOD[0]].admitted_at >= 3
    bad = _summary(r0)[BAD_COMPILE]
    assert bad[:2] == ("abort", "grammar_invalid") and bad[3] is None
    assert _summary(r0)[BAD_SPEC][:2] == ("abort", "schema_unsupported_feature")
    assert r0.outputs[BAD_SPEC].finished_at == 0
    for report in (r0, r1):
        assert all(n == 1 for n in report.compiles.values()), report.compiles


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_partitioned_dp_shares_poisoned_schema():
    plan = {
        0: {0: _wave(GOOD[:2]), 6: [("late/" + BAD_COMPILE, BAD_COMPILE)]},
        1: {0: _wave([BAD_COMPILE, GOOD[2]])},
    }
    r0, r1 = _attach({"requests": "partitioned"}, plan)

    assert len(r0.iterations) == len(r1.iterations)
    assert r1.outputs[BAD_COMPILE].error.startswith("grammar_invalid")
    late = r0.outputs["late/" + BAD_COMPILE]
    assert late.error.startswith("grammar_invalid") and "poisoned key" in late.error
    assert (late.admitted_at, late.finished_at) == (None, 6)
    # Rank 0 refused it from the shared poison, without compiling it.
    schema = load_records([BAD_COMPILE])[BAD_COMPILE].spec
    text = validate_spec(schema, GrammarConfig()).text
    assert r1.compiles.get(text) == 1 and text not in r0.compiles
    _assert_finished_well(r0, GOOD[:2])
    _assert_finished_well(r1, GOOD[2:3])


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_pp_stages_schedule_the_same_batches():
    waves = {0: _wave([*GOOD[:5], BAD_COMPILE, BAD_SPEC, PLAIN[0]]), 3: _wave(GOOD[5:])}
    s0, s1 = _start({"pp": 2}, {0: waves}, delay_s=COMPILE_DELAY_S)

    # FakeScheduler raises at the first iteration whose batches differ.
    assert len(s0.iterations) == len(s1.iterations)
    for a, b in zip(s0.iterations, s1.iterations):
        assert (a.ready, a.failed, a.batch) == (b.ready, b.failed, b.batch)
    assert _summary(s0) == _summary(s1)
    _assert_finished_well(s1, GOOD)
    assert _summary(s1)[BAD_COMPILE][:2] == ("abort", "grammar_invalid")
    # Each stage compiled every good spec itself (stage 1 waited for its own).
    assert s0.compiles.keys() == s1.compiles.keys()


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_idle_rank_still_steps():
    plan = {0: {0: _wave(GOOD[:3])}, 1: {0: _wave(PLAIN[:1]), 4: _wave(PLAIN[1:])}}
    r0, r1 = _attach({"requests": "partitioned"}, plan)

    assert len(r0.iterations) == len(r1.iterations)
    assert any(i.waiting_grammars for i in r0.iterations)
    # Rank 1 never held a grammar request, yet stepped with rank 0 every iteration.
    assert not any(i.waiting_grammars for i in r1.iterations)
    assert all(i.called for i in r0.iterations + r1.iterations)
    _assert_finished_well(r0, GOOD[:3])
    assert {o.finish_reason for o in r1.outputs.values()} <= {"stop", "length"}
    assert set(r1.outputs) == set(PLAIN)


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_guarded_get_ready_ends_at_the_deadline():
    plan = {0: {0: _wave(GOOD[:1])}, 1: {0: _wave(PLAIN[:1])}}
    results = _attach(
        {"requests": "partitioned"}, plan, step_timeout_s=3.0, guard=True, check=False
    )

    assert [r.error_type for r in results] == ["PeerLostError", "PeerLostError"], results
    # Rank 0 waits in the poison exchange of its get-ready call, rank 1 in
    # the end-of-iteration vote: different collectives, as in sglang#3600.
    assert "poison" in results[0].traceback
    assert "done vote" in results[1].traceback


# -- one process -------------------------------------------------------------------


@pytest.fixture
def tiny_manager(tiny_tokenizer):
    session = RankSession.local(
        tiny_tokenizer, SessionConfig(grammar=GrammarConfig(num_compile_workers=1))
    )
    manager = SGLangGrammarManager(session)
    yield manager
    manager.close()


def _settle(manager, timeout_s=30.0):
    """Call get-ready until something leaves the grammar queue; what left."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = manager.get_ready_grammar_requests()
        if got:
            return got
        time.sleep(0.002)
    raise AssertionError("nothing left the grammar queue")


def _admit(manager, req):
    assert manager.process_req_with_grammar(req)
    assert _settle(manager) == [req] and not req.finished(), req
    return req.grammar


def _row(grammar, vocab_size):
    mask = grammar.allocate_vocab_mask(vocab_size, 1, "cpu")
    grammar.fill_vocab_mask(mask, 0)
    return mask[0].clone()


@pytest.mark.parametrize(
    ("params", "spec"),
    [
        pytest.param(SamplingParams(), None, id="unconstrained"),
        pytest.param(
            SamplingParams(json_schema='{"type":"integer"}'),
            {"json": '{"type":"integer"}'},
            id="json",
        ),
        pytest.param(SamplingParams(json_schema=ANY_JSON), {"json_object": True}, id="any-json"),
        pytest.param(SamplingParams(regex="a+"), {"regex": "a+"}, id="regex"),
        pytest.param(
            SamplingParams(ebnf='root ::= "a"'),
            {"grammar": 'root ::= "a"', "grammar_syntax": "ebnf"},
            id="ebnf",
        ),
        pytest.param(SamplingParams(structural_tag="{}"), {"structural_tag": "{}"}, id="tag"),
        pytest.param(SamplingParams(regex="a+", ebnf="x"), {"regex": "a+"}, id="regex-first"),
    ],
)
def test_spec_from_sampling_params(params, spec):
    assert spec_from_sampling_params(params) == spec


def test_process_req_queues_only_what_must_wait(tiny_manager):
    plain = Req("plain", SamplingParams())
    assert not tiny_manager.process_req_with_grammar(plain)
    assert plain.grammar is None and not plain.finished()
    bad = Req("bad", SamplingParams(regex="a\0"))
    assert not tiny_manager.process_req_with_grammar(bad)
    assert bad.finished_reason == "abort" and bad.error.startswith("spec_regex_nul: ")
    assert not tiny_manager.has_waiting_grammars()
    good = Req("good", SamplingParams(regex="ab+c"))
    assert tiny_manager.process_req_with_grammar(good)
    assert tiny_manager.has_waiting_grammars() and len(tiny_manager) == 1
    assert tiny_manager.grammar_queue == [good]


def test_copy_is_independent_and_rollback_restores(tiny_manager, tiny_tokenizer):
    vocab = tiny_tokenizer.vocab_size
    a, b, c = (ord(ch) for ch in "abc")
    stop = tiny_tokenizer.stop_ids[0]
    g = _admit(tiny_manager, Req("r", SamplingParams(regex="ab+c")))
    assert g.is_bound and g.accepted_tokens == []
    g.accept_token(a)
    g.accept_token(b)
    twin = g.copy()
    assert not twin.is_bound and twin.accepted_tokens == [a, b]
    before = _row(g, vocab)
    assert torch.equal(_row(twin, vocab), before)

    twin.accept_token(c)
    twin.accept_token(stop)
    assert twin.is_terminated() and not g.is_terminated()
    assert g.accepted_tokens == [a, b]
    twin.accept_token(c)  # ignored once terminated, as SGLang's xgrammar backend does
    assert twin.accepted_tokens == [a, b, c, stop]

    twin.rollback(2)
    assert not twin.is_terminated() and twin.accepted_tokens == [a, b]
    assert torch.equal(_row(twin, vocab), before)
    # The original still masks and advances through the session.
    g.accept_token(b)
    assert torch.equal(_row(g, vocab), before)
    g.accept_token(c)
    # A copy of a copy, and a refused token, leave the source as it was.
    third = twin.copy()
    with pytest.raises(TokenRejected) as info:
        third.accept_token(a)
    assert info.value.code == "token_rejected" and isinstance(info.value, ValueError)
    assert third.accepted_tokens == twin.accepted_tokens == [a, b]


def test_masks_apply_and_refuse_a_stale_state(tiny_manager, tiny_tokenizer):
    vocab = tiny_tokenizer.vocab_size
    g = _admit(tiny_manager, Req("r", SamplingParams(regex="ab+c")))
    mask = g.allocate_vocab_mask(vocab, 2, "cpu")
    assert mask.dtype == torch.int32 and mask.shape == (2, (vocab + 31) // 32)
    g.fill_vocab_mask(mask, 1)
    mask = g.move_vocab_mask(mask, "cpu")
    logits = torch.zeros(2, vocab)
    g.apply_vocab_mask(logits, mask)
    assert torch.isfinite(logits[0]).all()  # row 0 was never filled: unconstrained
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [ord("a")]
    with pytest.raises(StaleGrammarState):
        g.fill_vocab_mask(mask, 1)
    g.accept_token(ord("a"))
    g.fill_vocab_mask(mask, 1)


def test_compile_failure_comes_back_finished_with_its_code(tiny_manager):
    req = Req("lookahead", SamplingParams(regex="(?=a)a"))
    assert tiny_manager.process_req_with_grammar(req)
    assert _settle(tiny_manager) == [req]
    assert req.finished_reason == "abort" and req.grammar is None
    (failure,) = tiny_manager.last_failed
    assert (failure.request_id, failure.code, failure.stage_only) == (
        req.rid,
        "grammar_invalid",
        False,
    )
    assert req.error == f"grammar_invalid: {failure.message}"


def test_abort_requests_come_back_finished(tiny_manager):
    keep = Req("keep-1", SamplingParams(regex="x+"))
    drop = Req("drop-1", SamplingParams(regex="y+"))
    for req in (keep, drop):
        assert tiny_manager.process_req_with_grammar(req)
    assert tiny_manager.abort_requests("drop") == [drop]
    assert drop.error == "Aborted by AbortReq." and tiny_manager.grammar_queue == [keep]
    got = tiny_manager.get_ready_grammar_requests()
    assert got[0] is drop


def test_finished_grammars_are_released(tiny_manager):
    g = _admit(tiny_manager, Req("r", SamplingParams(regex="a+")))
    session = tiny_manager.session
    assert session.is_running("r")
    g.finished = True
    tiny_manager.get_ready_grammar_requests()
    assert not session.is_running("r") and not g.is_bound
    g.accept_token(ord("a"))  # still usable on its own state


def test_jump_forward_paths_agree(tiny_tokenizer):
    config = SessionConfig(grammar=GrammarConfig(num_compile_workers=1, jump_forward=True))
    manager = SGLangGrammarManager(RankSession.local(tiny_tokenizer, config))
    try:
        g = _admit(manager, Req("r", SamplingParams(regex="abc(d|e)")))
        twin = g.copy()
        helper = g.try_jump_forward(None)
        assert helper is not None
        text, state = g.jump_forward_str_state(helper)
        assert text and "abc".startswith(text) and state == -1
        ids = tiny_tokenizer.encode(text)
        g.jump_and_retokenize([], ids, state)
        assert g.accepted_tokens == ids
        result = twin.jump_forward()
        assert result is not None and twin.accepted_tokens == ids
        with pytest.raises(TokenRejected):
            g.jump_and_retokenize(ids, [*ids, ord("z")], -1)
        assert g.accepted_tokens == ids
    finally:
        manager.close()


def test_later_stage_refuses_a_request_it_was_never_given(tiny_manager):
    # Stands in for a later stage's view: arrivals naming an unknown request.
    from gramcoord.rank_worker.engine.frames import Arrivals, Submitted

    with pytest.raises(StageMismatch, match="never given"):
        tiny_manager._add_arrivals(Arrivals(step=0, requests=(Submitted("x", 0, "{}"),)))


def test_one_process_loop_finishes_every_request(qwen_tokenizer):
    session = RankSession.local(
        qwen_tokenizer, SessionConfig(grammar=GrammarConfig(num_compile_workers=1))
    )
    manager = SGLangGrammarManager(session)
    records = load_records([*GOOD, BAD_COMPILE, PLAIN[0]])
    reqs = [to_req(records[rid]) for rid in [*GOOD, BAD_COMPILE, PLAIN[0]]]
    try:
        report = FakeScheduler(manager, {0: reqs}).event_loop()
    finally:
        manager.close()
    _assert_finished_well(report, GOOD)
    assert report.outputs[BAD_COMPILE].error.startswith("grammar_invalid")
    assert report.outputs[GOOD[4]].text in ("positive", "negative", "neutral")
    assert report.outputs[PLAIN[0]].admitted_at == 0


def test_example_runs_on_one_process(capsys):
    from gramcoord.rank_worker.integrations.examples import sglang_scheduler

    assert sglang_scheduler.main(["--max-new-tokens", "24"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(sglang_scheduler.REQUESTS)
    assert all(line.startswith("[rank 0] ") for line in lines)
    assert any("refused" in line and "grammar_invalid" in line for line in lines)


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_example_under_torchrun():
    module = "gramcoord.rank_worker.integrations.examples.sglang_scheduler"
    torchrun = Path(sys.executable).with_name("torchrun")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            str(torchrun),
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "-m",
            module,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("[rank ")]
    assert {line[:8] for line in lines} == {"[rank 0]", "[rank 1]"}
    late = next(line for line in lines if "refused-again" in line)
    assert "poisoned key" in late
