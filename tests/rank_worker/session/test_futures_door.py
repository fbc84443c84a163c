"""The door of host engines (``GrammarFutures.for_host``): a host hands over what its
grammar manager is made of and then calls only the door's verbs."""

from __future__ import annotations

import xgrammar as xgr

from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.errors import ErrorCode
from gramcoord.rank_worker.grammars.compile_service import XGrammarBackend
from gramcoord.rank_worker.session.futures import GrammarFutures

SPEC = {"json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}


def _door(tokenizer, **kw) -> GrammarFutures:
    backend = XGrammarBackend(tokenizer)
    return GrammarFutures.for_host(
        GrammarConfig(compile_mode="async", num_compile_workers=1),
        tokenizer,
        backend,
        None,
        admit=lambda o: ("admitted", o.request_id),
        refuse=lambda o: ("refused", o.code),
        **kw,
    )


def _decide(door: GrammarFutures, future) -> object:
    for _ in range(600):
        door.wait(0.05)
        door.step()
        if future.done():
            return future.result()
    raise AssertionError("no decision in 600 steps")


def test_a_host_runs_a_request_through_the_verbs_alone(tiny_tokenizer):
    door = _door(tiny_tokenizer)
    try:
        assert door.group_size == 1 and door.num_collectives == 0
        future = door.submit("r1", SPEC)
        assert _decide(door, future) == ("admitted", "r1")
        compiled = door.compiled("r1")
        assert isinstance(compiled, xgr.CompiledGrammar)
        door.release("r1")
        assert door.num_live == 0

        # The cache verbs: a hit serves the same compiled grammar, without a step.
        found = door.lookup(SPEC)
        assert found.key is not None and found.compiled is compiled and found.failed is None

        # A host's own timeout poisons the key: the next request is refused at once.
        assert door.poison(SPEC, ErrorCode.grammar_timeout, "the host's deadline")
        refused = door.submit("r2", SPEC)
        assert refused.done() and refused.result() == ("refused", "grammar_timeout")
        # Poison comes first, as in submit, though the key is still compiled here.
        found = door.lookup(SPEC)
        assert found.compiled is None and found.failed.code == "grammar_timeout"

        # A flush drops compiled grammars and keeps the poison (agreed state).
        other = {"regex": "[0-9]{3}"}
        assert _decide(door, door.submit("r3", other))[0] == "admitted"
        door.release("r3")
        assert door.lookup(other).compiled is not None
        door.clear_cache()
        assert door.lookup(other).compiled is None and door.lookup(SPEC).failed is not None
    finally:
        door.close()


def test_the_gap_defaults_to_the_agreements_option_and_a_host_may_pin_it(tiny_tokenizer):
    default, pinned = _door(tiny_tokenizer), _door(tiny_tokenizer, max_gap=1)
    try:
        assert default._max_gap == 8 and pinned._max_gap == 1
    finally:
        default.close()
        pinned.close()


def test_bad_input_is_refused_through_the_door_not_raised(tiny_tokenizer):
    door = _door(tiny_tokenizer)
    try:
        future = door.submit("bad", {"json": "{not json"})
        assert future.done() and future.result()[0] == "refused"
        assert door.lookup({"json": "{not json"}).key is None
        assert not door.poison({"json": "{not json"}, ErrorCode.grammar_timeout, "x")
    finally:
        door.close()
