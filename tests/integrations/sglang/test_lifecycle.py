"""SGLang's real ``GrammarManager`` over our backend in one process: the paths around readiness.

Aborts (``abort_requests``), SGLang's own poll-count timeout (the request
is cancelled, and ``set_cache`` poisons the key for a TTL where SGLang
would cache the failure for ever), our compile deadline firing while SGLang
only polls ``done()`` (the abort carries ``grammar_timeout``), ``flush_cache``
(``clear``), and the setups ``create_backend`` refuses at start.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

from tests.integrations.sglang.host import host, one_rank_manager, publish
from tests.integrations.sglang.ranks import Req, drive, schemas

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def held(monkeypatch):
    """Compiles wait until the test releases them."""
    from gramcoord.integrations.sglang.backend import SglangBackend

    gate = threading.Event()
    real = SglangBackend._compile

    def compile_(self, spec):
        gate.wait(30)
        return real(self, spec)

    monkeypatch.setattr(SglangBackend, "_compile", compile_)
    yield gate
    gate.set()


@pytest.fixture
def manager():
    m = one_rank_manager()
    yield m
    m.grammar_backend.close()


def test_abort_releases_our_state(held, manager) -> None:
    backend = manager.grammar_backend
    req = Req("r0", schemas()[0])
    assert manager.process_req_with_grammar(req)
    assert backend.grammars.num_undecided == 1
    manager.abort_requests(SimpleNamespace(rid="r0", abort_all=False))
    (back,) = manager.get_ready_grammar_requests()
    assert back is req and req.finished()
    assert backend.grammars.num_undecided == 0
    assert backend.grammars.num_live == 0


def test_sglangs_poll_timeout_poisons_for_a_ttl(held, manager) -> None:
    backend = manager.grammar_backend
    manager.SGLANG_GRAMMAR_MAX_POLL_ITERATIONS = 2
    schema = schemas()[1]
    log = drive(manager, {0: [Req("t0", schema)]})
    assert log[-1][1:] == (
        "t0",
        f"aborted: Grammar preprocessing timed out: req.grammar_key={('json', schema)!r}",
    )
    assert backend.grammars.num_live == 0
    again = Req("t1", schema)
    assert not manager.process_req_with_grammar(again)  # refused at once: poisoned
    assert "grammar_timeout: cached verdict" in again.finished_reason
    (entry,) = backend.grammars.leader._manager.caches.poison._items.values()
    assert entry.expires_ms > 0  # a TTL, not for ever


def test_our_deadline_fires_while_sglang_polls_done(held, manager) -> None:
    backend = manager.grammar_backend
    backend.grammars.leader._manager.service.timeout_s = 0.5  # compile_timeout_s (30 s by default)
    manager.SGLANG_GRAMMAR_MAX_POLL_ITERATIONS = 10**6  # SGLang's own timeout: never
    schema = schemas()[3]
    log = drive(manager, {0: [Req("d0", schema)]})
    assert log[-1][1:] == (
        "d0",
        "aborted: Failed to compile json grammar: grammar_timeout: "
        "compile ran past GRAMCOORD_SGLANG_OPTIONS.compile_timeout_s=0.5s "
        "(its own time: waits for a CPU are not counted)",
    )
    assert backend.grammars.num_live == 0
    again = Req("d1", schema)
    assert not manager.process_req_with_grammar(again)  # poisoned for a TTL
    assert "grammar_timeout" in again.finished_reason


def test_flush_cache_drops_compiled_grammars(manager) -> None:
    schema = schemas()[2]
    log = drive(manager, {0: [Req("f0", schema)]})
    assert log[-1][2] == "SglangGrammar"
    hit = Req("f1", schema)
    assert not manager.process_req_with_grammar(hit)  # SGLang's cache-hit path
    assert type(hit.grammar).__name__ == "SglangGrammar"
    manager.clear()
    assert manager.process_req_with_grammar(Req("f2", schema))  # compiles again


@pytest.mark.parametrize(
    "option",
    [
        pytest.param({"reasoning_parser": "qwen3"}, id="reasoning-parser"),
        pytest.param({"pp_size": 2}, id="pipeline"),
    ],
)
def test_unsupported_setups_are_refused_at_start(option) -> None:
    from sglang.srt import runtime_context
    from sglang.srt.constrained.base_grammar_backend import create_grammar_backend
    from sglang.srt.server_args import ServerArgs

    h = host()
    args = ServerArgs(
        model_path=h.server_args.model_path, grammar_backend="gramcoord", device="cpu", **option
    )
    args._resolution_finished = True
    runtime_context.publish(args, role="test")
    try:
        with pytest.raises(ValueError, match="does not support"):
            create_grammar_backend(args, h.tokenizer, h.vocab_size, h.eos_token_ids)
    finally:
        publish("gramcoord", h.server_args.model_path)


def test_a_breach_of_a_schema_enforced_in_part_aborts_with_its_code(manager) -> None:
    """The grammar emits exactly the enum value and cannot enforce the
    calendar of format "date": at the stop token the end check finds the
    breach, and SGLang's scheduler aborts on the ValueError it raises
    (its message is the abort's). Overlapping oneOf branches (enforced as
    anyOf) are checked the same way: an output in one branch finishes, one
    in both aborts."""
    import json

    from tests.integrations.sglang.host import EOS_IDS

    backend = manager.grammar_backend
    tokenizer = host().tokenizer

    def grammar_of(schema):
        value, _ = backend.get_cached_or_future_value(("json", json.dumps(schema)), False)
        return value.result() if hasattr(value, "result") else value

    def follow(grammar, text):
        for token in tokenizer.encode(text, add_special_tokens=False):
            grammar.accept_token(token)
        grammar.accept_token(EOS_IDS[0])

    breached = {"type": "string", "enum": ["2022-02-30"], "format": "date"}
    for attempt in ("compiled", "cache hit"):
        grammar = grammar_of(breached)
        with pytest.raises(ValueError, match=r"^gramcoord schema_breach: ") as info:
            follow(grammar, '"2022-02-30"')
        assert "'2022-02-30' is not a 'date'" in str(info.value), attempt
    overlap = {"oneOf": [{"type": "string", "enum": ["ab"]}, {"type": "string", "maxLength": 3}]}
    held = grammar_of(overlap)
    follow(held, '"abc"')
    assert held.is_terminated()
    with pytest.raises(ValueError, match="is valid under each of"):
        follow(grammar_of(overlap), '"ab"')
    assert backend.grammars.num_live == 0
