"""GrammarState: accept / validate / rollback, termination, stop and special
tokens, the reasoning gate and triggers, on the tiny and the Qwen vocabulary."""

from __future__ import annotations

import numpy as np
import pytest
import xgrammar as xgr

from gramcoord.rank_worker.errors import ErrorCode, GrammarError
from gramcoord.rank_worker.masks.gate import Gate, Phase
from gramcoord.rank_worker.masks.grammar_state import (
    GrammarState,
    clear_bits,
    live_rows,
    strip_padding,
)

OBJECT = {"type": "object"}
STRING_FIELD = {
    "type": "object",
    "properties": {"a": {"type": "string"}},
    "required": ["a"],
}


def mask(state: GrammarState) -> np.ndarray:
    row = np.zeros((1, (state.vocab_size + 31) // 32), dtype=np.int32)
    state.fill_row(row, 0)
    return row[0]


def allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def fresh_after(compiled, tokens) -> np.ndarray:
    matcher = xgr.GrammarMatcher(compiled)
    for t in tokens:
        assert matcher.accept_token(t)
    row = np.zeros((1, (compiled.tokenizer_info.vocab_size + 31) // 32), dtype=np.int32)
    matcher.fill_next_token_bitmask(row, 0)
    return row[0]


def expect_error(code: ErrorCode, fn, *args):
    with pytest.raises(GrammarError) as info:
        fn(*args)
    assert info.value.code == code, info.value
    return info.value


@pytest.mark.parametrize(
    ("drafts", "stripped"),
    [
        pytest.param([3, 4, -1, -1], [3, 4], id="trailing"),
        pytest.param([-1, -1], [], id="all-padding"),
        pytest.param([3, -1, 4], [3], id="cut-at-first"),
        pytest.param([], [], id="empty"),
        pytest.param([5, 6], [5, 6], id="none"),
    ],
)
def test_strip_padding(drafts, stripped):
    assert strip_padding(drafts) == stripped


@pytest.mark.parametrize(
    ("text", "valid_text"),
    [
        pytest.param('"a": "b"}', '"a": "b"}', id="all-valid"),
        pytest.param('"a"z', '"a"', id="stops-at-invalid"),
        pytest.param('z"', "", id="first-invalid"),
    ],
)
def test_validate_tokens_is_longest_prefix_and_pure(any_tokenizer, compile_json, text, valid_text):
    compiled = compile_json(any_tokenizer, OBJECT)
    state = GrammarState(compiled)
    state.accept_tokens(any_tokenizer.encode("{"))
    row, count = mask(state), state.num_tokens
    tokens = any_tokenizer.encode(text)
    # Oracle: a bare matcher, token by token.
    oracle = xgr.GrammarMatcher(compiled)
    assert oracle.accept_string("{")
    n = 0
    while n < len(tokens) and oracle.accept_token(tokens[n]):
        n += 1
    got = state.validate_tokens(tokens)
    assert got == tokens[:n]
    assert any_tokenizer.decode(got) == valid_text
    np.testing.assert_array_equal(mask(state), row)
    assert state.num_tokens == count


def test_accept_is_all_or_nothing(any_tokenizer, compile_json, piece):
    state = GrammarState(compile_json(any_tokenizer, OBJECT))
    good = any_tokenizer.encode('{"a"')
    state.accept_tokens(good)
    row = mask(state)
    err = expect_error(
        ErrorCode.token_rejected,
        state.accept_tokens,
        [*any_tokenizer.encode(":"), piece(any_tokenizer, "z")],
    )
    assert "position 1" in err.message
    assert state.num_tokens == len(good)
    np.testing.assert_array_equal(mask(state), row)


def test_terminated_grammar_accepts_nothing(any_tokenizer, compile_json):
    compiled = compile_json(any_tokenizer, OBJECT)
    state = GrammarState(compiled)
    state.accept_tokens(any_tokenizer.encode('{"a": "b"}'))
    assert not state.is_terminated
    state.accept_tokens([any_tokenizer.eos_id])
    assert state.is_terminated
    space = any_tokenizer.encode(" ")
    expect_error(ErrorCode.grammar_terminated, state.accept_tokens, space)
    expect_error(ErrorCode.grammar_terminated, mask, state)
    assert state.validate_tokens(space) == []
    # Rolling back the stop token revives the grammar.
    state.rollback(1)
    assert not state.is_terminated
    assert allowed(mask(state), any_tokenizer.eos_id)


def test_rollback_and_reset(any_tokenizer, compile_json):
    compiled = compile_json(any_tokenizer, OBJECT)
    state = GrammarState(compiled)
    tokens = any_tokenizer.encode('{"a": 1')
    state.accept_tokens(tokens)
    with pytest.raises(ValueError, match="roll back"):
        state.rollback(len(tokens) + 1)
    state.rollback(2)
    np.testing.assert_array_equal(mask(state), fresh_after(compiled, tokens[:-2]))
    state.reset()
    assert state.num_tokens == 0
    np.testing.assert_array_equal(mask(state), fresh_after(compiled, []))


def test_from_matcher_wraps_an_existing_matcher(any_tokenizer, compile_json):
    compiled = compile_json(any_tokenizer, OBJECT)
    state = GrammarState.from_matcher(
        xgr.GrammarMatcher(compiled), vocab_size=any_tokenizer.vocab_size
    )
    tokens = any_tokenizer.encode('{"a"')
    state.accept_tokens(tokens)
    np.testing.assert_array_equal(mask(state), fresh_after(compiled, tokens))
    assert state.vocab_size == compiled.tokenizer_info.vocab_size


def test_eos_is_masked_until_the_grammar_can_end(any_tokenizer, compile_json):
    state = GrammarState(compile_json(any_tokenizer, STRING_FIELD))
    text = '{"a": "b c"}'
    tokens = any_tokenizer.encode(text)
    for i, t in enumerate(tokens):
        row = mask(state)
        for stop in any_tokenizer.stop_ids:
            assert not allowed(row, stop), f"stop {stop} allowed after {tokens[:i]}"
        state.accept_tokens([t])
    row = mask(state)
    assert all(allowed(row, stop) for stop in any_tokenizer.stop_ids)


def test_user_stop_id_is_blocked_inside_a_string(any_tokenizer, compile_json, piece):
    x = piece(any_tokenizer, "x")
    compiled = compile_json(any_tokenizer, STRING_FIELD)
    state = GrammarState(compiled, stop_token_ids=[*any_tokenizer.stop_ids, x])
    plain = GrammarState(compiled)
    prefix = any_tokenizer.encode('{"a": "')
    state.accept_tokens(prefix)
    plain.accept_tokens(prefix)
    assert allowed(mask(plain), x), "x is ordinary string content"
    assert not allowed(mask(state), x), "a stop id must not appear inside a string"
    state.accept_tokens(any_tokenizer.encode('b"}'))
    assert allowed(mask(state), x)
    state.accept_tokens([x])
    assert state.is_terminated


def test_non_stop_special_tokens_are_never_allowed(any_tokenizer, compile_json):
    specials = set(any_tokenizer.special_ids.values()) - set(any_tokenizer.stop_ids)
    assert specials
    state = GrammarState(compile_json(any_tokenizer, STRING_FIELD))
    for t in [None, *any_tokenizer.encode('{"a": "b"}')]:
        if t is not None:
            state.accept_tokens([t])
        row = mask(state)
        assert not any(allowed(row, s) for s in specials)
    assert state.validate_tokens(sorted(specials)[:1]) == []


def test_reasoning_tokens_do_not_reach_the_grammar(any_tokenizer, compile_json):
    compiled = compile_json(any_tokenizer, OBJECT)
    end = sorted(set(any_tokenizer.special_ids.values()) - set(any_tokenizer.stop_ids))[0]
    state = GrammarState(compiled, gate=Gate(think_end_ids=[end]))
    thoughts = any_tokenizer.encode("z [ }")
    assert not state.fill_row(np.zeros((1, (state.vocab_size + 31) // 32), np.int32), 0)
    assert (mask(state) == -1).all()
    brace = any_tokenizer.encode("{")
    state.accept_tokens([*thoughts, end, *brace])
    assert state.phase == Phase.CONSTRAINED
    np.testing.assert_array_equal(mask(state), fresh_after(compiled, brace))
    # Back across the boundary: reasoning again, grammar untouched.
    state.rollback(len(brace) + 1)
    assert state.phase == Phase.REASONING and state.num_tokens == len(thoughts)
    assert (mask(state) == -1).all()
    state.accept_tokens([end])
    np.testing.assert_array_equal(mask(state), fresh_after(compiled, []))


def test_implicit_end_rejected_as_first_content_is_masked(any_tokenizer, compile_json, piece):
    compiled = compile_json(any_tokenizer, OBJECT)
    brace, bracket = piece(any_tokenizer, "{"), piece(any_tokenizer, "[")
    state = GrammarState(compiled, gate=Gate(implicit_end_ids=[brace, bracket]))
    assert state.masked_ids == (bracket,)
    row = mask(state)
    assert allowed(row, brace) and not allowed(row, bracket)
    assert (np.delete(row, bracket >> 5) == -1).all()
    expect_error(ErrorCode.token_rejected, state.accept_tokens, [bracket])
    assert state.validate_tokens([bracket]) == []
    # The implicit end is content: the grammar sees it.
    state.accept_tokens([*any_tokenizer.encode("hmm"), brace])
    assert state.phase == Phase.CONSTRAINED
    np.testing.assert_array_equal(mask(state), fresh_after(compiled, [brace]))
    state.rollback(1)
    assert state.phase == Phase.REASONING
    np.testing.assert_array_equal(mask(state), row)


def test_trigger_starts_the_constraint_and_rolls_back(any_tokenizer, compile_json):
    compiled = compile_json(any_tokenizer, OBJECT)
    trigger = any_tokenizer.encode("<call>")
    assert len(trigger) >= 2
    state = GrammarState(compiled, gate=Gate(triggers=[trigger]))
    chatter = any_tokenizer.encode("hi <ca")
    state.accept_tokens(chatter)
    assert state.phase == Phase.AWAIT_TRIGGER and (mask(state) == -1).all()
    brace = any_tokenizer.encode("{")
    state.accept_tokens([*trigger, *brace])
    np.testing.assert_array_equal(mask(state), fresh_after(compiled, brace))
    # Roll back into the middle of the trigger: the partial match survives.
    state.rollback(len(brace) + 1)
    assert state.phase == Phase.AWAIT_TRIGGER
    state.accept_tokens(trigger[-1:])
    assert state.phase == Phase.CONSTRAINED
    # Roll back before the trigger: it must be matched again from scratch.
    state.rollback(len(trigger))
    state.accept_tokens(trigger[-1:])
    assert state.phase == Phase.AWAIT_TRIGGER


def test_dead_state_is_reported_on_accept():
    vocab = ["a", "b", "</s>"]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=[2])
    compiled = xgr.GrammarCompiler(info).compile_grammar('root ::= "a" "c"')
    state = GrammarState(compiled)
    state.accept_tokens([0])
    assert not live_rows(mask(state)[None, :], 3)[0]
    expect_error(ErrorCode.grammar_dead_state, state.accept_tokens, [1])
    assert state.num_tokens == 1


@pytest.mark.parametrize(
    ("vocab_size", "row", "live"),
    [
        pytest.param(40, [0, 0], False, id="zero"),
        pytest.param(40, [0, 1 << 7], True, id="last-real-bit"),
        pytest.param(40, [0, 1 << 8], False, id="padding-bit-only"),
        pytest.param(64, [0, -(1 << 31)], True, id="top-bit-full-word"),
        pytest.param(64 * 32, {40: 1}, True, id="wide-bit-past-the-probe"),
        pytest.param(64 * 32 + 5, {64: 1 << 4}, True, id="wide-last-real-bit"),
        pytest.param(64 * 32 + 5, {64: 1 << 5}, False, id="wide-padding-bit-only"),
        pytest.param(64 * 32, {}, False, id="wide-zero"),
    ],
)
def test_live_rows_ignores_padding_bits(vocab_size, row, live):
    if isinstance(row, dict):
        words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        for word, value in row.items():
            words[word] = value
        row = words
    rows = np.array([row, row], dtype=np.int32)
    rows[0] = -1  # a live neighbour must not hide the verdict
    assert live_rows(rows, vocab_size).tolist() == [True, live]


def test_clear_bits():
    row = np.full(3, -1, dtype=np.int32)
    clear_bits(row, [0, 31, 33])
    assert [allowed(row, t) for t in (0, 1, 31, 32, 33, 34)] == [0, 1, 0, 1, 0, 1]
