"""BitmaskBuilder: speculative rows, trimming, invariants, dead states,
parallel fill and buffer reuse."""

from __future__ import annotations

import numpy as np
import pytest
import xgrammar as xgr

from gramcoord.rank_worker.errors import ErrorCode
from gramcoord.rank_worker.masks.bitmask import BitmaskBuilder, trim_drafts
from gramcoord.rank_worker.masks.gate import Gate
from gramcoord.rank_worker.masks.grammar_state import GrammarState

OBJECT = {"type": "object"}
EOS = "<eos>"
END = "<end>"


def think_end(tokenizer) -> int:
    """A non-stop special token used as the think-end marker."""
    return sorted(set(tokenizer.special_ids.values()) - set(tokenizer.stop_ids))[0]


def ids(tokenizer, piece, pieces) -> list[int]:
    special = {EOS: tokenizer.eos_id, END: think_end(tokenizer)}
    return [special[p] if p in special else piece(tokenizer, p) for p in pieces]


def pattern(bitmask: np.ndarray) -> str:
    return "".join("U" if (row == -1).all() else "C" for row in bitmask)


def next_mask(state: GrammarState) -> np.ndarray:
    row = np.zeros((1, (state.vocab_size + 31) // 32), dtype=np.int32)
    state.fill_row(row, 0)
    return row[0]


# (vocab, text accepted after the think-end marker, drafts, K, kept, rows); an
# empty text means the request is still reasoning.
SPECULATIVE = [
    pytest.param("qwen", '{"a"', [":", ' "', "b", '"}'], 4, 4, "CCCCC", id="qwen-all-kept"),
    pytest.param("qwen", '{"a"', ["z", ":", ' "', "b"], 4, 0, "CUUUU", id="qwen-none-kept"),
    pytest.param("qwen", '{"a"', [":", "z", ' "', "b"], 4, 1, "CCUUU", id="qwen-one-kept"),
    pytest.param("qwen", '{"a": "b"}', [EOS, " ", " "], 3, 1, "CUUU", id="qwen-eos"),
    pytest.param("qwen", "", [END, "{", ' "', "b"], 4, 4, "UCCCC", id="qwen-end-first"),
    pytest.param("qwen", "", [" ", END, "{", ' "'], 4, 4, "UUCCC", id="qwen-end-second"),
    pytest.param("qwen", "", [" ", " ", END], 3, 3, "UUUC", id="qwen-end-last"),
    pytest.param("tiny", '{"a"', [":", " ", '"', "b"], 4, 4, "CCCCC", id="tiny-all-kept"),
    pytest.param("tiny", '{"a"', ["z", ":", " ", '"'], 4, 0, "CUUUU", id="tiny-none-kept"),
    pytest.param("tiny", '{"a"', [":", "z", " ", '"'], 4, 1, "CCUUU", id="tiny-one-kept"),
    pytest.param("tiny", '{"a":"b"}', [EOS, " ", " "], 3, 1, "CUUU", id="tiny-eos"),
    pytest.param("tiny", "", [END, "{", " ", '"'], 4, 4, "UCCCC", id="tiny-end-first"),
    pytest.param("tiny", "", [" ", END, "{", " "], 4, 4, "UUCCC", id="tiny-end-second"),
    pytest.param("tiny", "", [" ", " ", END], 3, 3, "UUUC", id="tiny-end-last"),
]


@pytest.mark.parametrize(("vocab", "prefix", "pieces", "k", "kept", "rows"), SPECULATIVE)
def test_speculative_rows(request, compile_json, piece, vocab, prefix, pieces, k, kept, rows):
    tokenizer = request.getfixturevalue(f"{vocab}_tokenizer")
    compiled = compile_json(tokenizer, OBJECT)
    end = think_end(tokenizer)
    state = GrammarState(compiled, gate=Gate(think_end_ids=[end]))
    if prefix:
        # "Reasoning ended" before the prefix.
        state.accept_tokens([end, *tokenizer.encode(prefix)])
    drafts = ids(tokenizer, piece, pieces)
    before = (state.validate_tokens(drafts), state.num_tokens, next_mask(state))

    builder = BitmaskBuilder(tokenizer.vocab_size, max_num_seqs=2, num_speculative_tokens=k)
    result = builder.build([state], [drafts])
    assert result.failures == {}
    assert pattern(result.bitmask) == rows
    validated = trim_drafts(state, drafts)
    assert validated == drafts[:kept]
    # Rows before the first constrained one are the reasoning rows.
    assert state.constraint_bounds(drafts) == (rows.index("C"), rows.index("C"))

    # Invariants: a build changes nothing ...
    after = (state.validate_tokens(drafts), state.num_tokens, next_mask(state))
    assert after[0] == before[0] and after[1] == before[1]
    np.testing.assert_array_equal(after[2], before[2])
    # ... every constrained row is the plain next mask at its position, and
    # row len(validated) is the mask with no drafts after the kept prefix.
    for i in range(len(validated) + 1):
        if rows[i] == "C":
            state.accept_tokens(validated[:i])
            np.testing.assert_array_equal(result.bitmask[i], next_mask(state))
            state.rollback(i)
    # ... and everything after a rejected draft or a stop token is free.
    assert set(rows[len(validated) + 1 :]) <= {"U"}


def test_eos_draft_terminates_the_grammar(qwen_tokenizer, compile_json):
    state = GrammarState(compile_json(qwen_tokenizer, OBJECT))
    state.accept_tokens(qwen_tokenizer.encode('{"a": "b"}'))
    kept = trim_drafts(state, [qwen_tokenizer.eos_id, 220, 220])
    assert kept == [qwen_tokenizer.eos_id]
    state.accept_tokens(kept)
    assert state.is_terminated


def test_trim_drops_padding(tiny_tokenizer, compile_json):
    state = GrammarState(compile_json(tiny_tokenizer, OBJECT))
    brace, quote = tiny_tokenizer.encode("{")[0], tiny_tokenizer.encode('"')[0]
    assert trim_drafts(state, [brace, quote, -1, brace]) == [brace, quote]
    assert trim_drafts(state, [-1, brace]) == []


@pytest.mark.parametrize(
    ("drafts", "rows"),
    [
        pytest.param([-1, -1, -1], "CUUU", id="all-padding"),
        pytest.param(["{", -1, -1], "CCUU", id="padding-after-one"),
        pytest.param(["{", -1, '"'], "CCUU", id="padding-in-middle"),
        pytest.param(["{", '"'], "CCCU", id="short"),
    ],
)
def test_padding_rows(tiny_tokenizer, compile_json, piece, drafts, rows):
    state = GrammarState(compile_json(tiny_tokenizer, OBJECT))
    tokens = [d if d == -1 else piece(tiny_tokenizer, d) for d in drafts]
    builder = BitmaskBuilder(tiny_tokenizer.vocab_size, max_num_seqs=1, num_speculative_tokens=3)
    assert pattern(builder.build([state], [tokens]).bitmask) == rows
    assert state.num_tokens == 0


def test_reasoning_rows_mask_rejected_implicit_ends(tiny_tokenizer, compile_json, piece):
    brace, bracket = piece(tiny_tokenizer, "{"), piece(tiny_tokenizer, "[")
    space = piece(tiny_tokenizer, " ")
    state = GrammarState(
        compile_json(tiny_tokenizer, OBJECT), gate=Gate(implicit_end_ids=[brace, bracket])
    )
    builder = BitmaskBuilder(tiny_tokenizer.vocab_size, max_num_seqs=1, num_speculative_tokens=2)
    bitmask = builder.build([state], [[space, brace]]).bitmask
    for row in bitmask[:2]:  # both reasoning rows: only '[' is masked
        words = row.view(np.uint32)
        assert not (words[bracket >> 5] >> (bracket & 31)) & 1
        assert (words[brace >> 5] >> (brace & 31)) & 1
    # The implicit end is the first content token: the last row is after it.
    np.testing.assert_array_equal(bitmask[2], next_mask_after(state, [space, brace]))
    assert state.constraint_bounds([space, brace]) == (1, 2)


def next_mask_after(state: GrammarState, tokens: list[int]) -> np.ndarray:
    state.accept_tokens(tokens)
    row = next_mask(state)
    state.rollback(len(tokens))
    return row


@pytest.fixture(scope="module")
def micro():
    """a, b, c and a stop: ``"a" "d"`` dies after ``a`` (no token spells d)."""
    info = xgr.TokenizerInfo(["a", "b", "c", "</s>"], xgr.VocabType.RAW, stop_token_ids=[3])
    compiler = xgr.GrammarCompiler(info)
    return {
        "ok": compiler.compile_grammar('root ::= "a" "b" "c"'),
        "dies": compiler.compile_grammar('root ::= "a" "d"'),
    }


@pytest.mark.parametrize(("k", "threshold"), [(0, 128), (0, 1), (2, 128)])
def test_dead_state_fails_only_that_request(micro, k, threshold):
    live, dead, other = (
        GrammarState(micro["ok"]),
        GrammarState(micro["dies"]),
        GrammarState(micro["ok"]),
    )
    dead.accept_tokens([0])
    builder = BitmaskBuilder(
        4, max_num_seqs=3, num_speculative_tokens=k, parallel_threshold=threshold
    )
    result = builder.build([live, dead, other], [[], [], []])
    assert set(result.failures) == {1}
    assert result.failures[1].code == ErrorCode.grammar_dead_state
    rows = result.bitmask.reshape(3, k + 1, -1)
    assert (rows[1] == -1).all()
    for state, block in ((live, rows[0]), (other, rows[2])):
        np.testing.assert_array_equal(block[0], next_mask(state))


def test_dead_row_reached_by_drafts_frees_later_rows(micro):
    state = GrammarState(micro["dies"])
    builder = BitmaskBuilder(4, max_num_seqs=1, num_speculative_tokens=2)
    result = builder.build([state], [[0, 1]])
    assert result.failures == {}
    assert pattern(result.bitmask) == "CUU"
    assert state.num_tokens == 0


def test_terminated_request_fails_alone(tiny_tokenizer, compile_json):
    done = GrammarState(compile_json(tiny_tokenizer, OBJECT))
    done.accept_tokens([*tiny_tokenizer.encode("{}"), tiny_tokenizer.eos_id])
    fresh = GrammarState(compile_json(tiny_tokenizer, OBJECT))
    for k in (0, 1):
        builder = BitmaskBuilder(
            tiny_tokenizer.vocab_size, max_num_seqs=2, num_speculative_tokens=k
        )
        result = builder.build([done, fresh])
        assert [(i, e.code) for i, e in result.failures.items()] == [
            (0, ErrorCode.grammar_terminated)
        ]
        assert (result.bitmask[: k + 1] == -1).all()
        np.testing.assert_array_equal(result.bitmask[k + 1], next_mask(fresh))


def test_parallel_fill_equals_sequential(tiny_tokenizer, compile_json, micro):
    compiled = compile_json(
        tiny_tokenizer, {"type": "object", "properties": {"x": {"type": "integer"}}}
    )
    texts = ["", "{", '{"x"', '{"x": 1', '{"x": 12}', "{ "]
    end = think_end(tiny_tokenizer)

    def states():
        out = []
        for i in range(40):
            gate = Gate(think_end_ids=[end]) if i % 7 == 3 else None
            s = GrammarState(compiled, gate=gate)
            if gate is None:
                s.accept_tokens(tiny_tokenizer.encode(texts[i % len(texts)]))
            out.append(s)
        out[4].accept_tokens([tiny_tokenizer.eos_id])  # '{"x": 12}' then stop
        return out

    seq = BitmaskBuilder(tiny_tokenizer.vocab_size, max_num_seqs=40, parallel_threshold=1000)
    par = BitmaskBuilder(
        tiny_tokenizer.vocab_size, max_num_seqs=40, parallel_threshold=8, num_threads=2
    )
    a, b = seq.build(states()), par.build(states())
    np.testing.assert_array_equal(a.bitmask, b.bitmask)
    assert {i: e.code for i, e in a.failures.items()} == {i: e.code for i, e in b.failures.items()}
    assert set(a.failures) == {4}
    assert pattern(a.bitmask[3:4]) == "U"


def test_buffer_is_allocated_once(tiny_tokenizer, compile_json):
    state = GrammarState(compile_json(tiny_tokenizer, OBJECT))
    builder = BitmaskBuilder(tiny_tokenizer.vocab_size, max_num_seqs=4, num_speculative_tokens=1)
    first = builder.build([state] * 3, [[-1]] * 3).bitmask
    second = builder.build([state], [[tiny_tokenizer.encode("{")[0]]]).bitmask
    assert first.shape == (6, 9) and second.shape == (2, 9)
    assert first.ctypes.data == second.ctypes.data
    assert np.shares_memory(first, second)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"n": 3}, "max_num_seqs", id="too-many-requests"),
        pytest.param({"drafts": [[1, 2, 3]]}, "drafts", id="too-many-drafts"),
        pytest.param({"drafts": [[], []]}, "draft lists", id="draft-count"),
        pytest.param({"vocab": 64}, "vocabulary", id="vocab-mismatch"),
        pytest.param({"vocab": 64, "k": 0}, "vocabulary", id="vocab-mismatch-k0"),
        pytest.param({"drafts": [[1]], "k": 0}, "K=0", id="drafts-without-k"),
    ],
)
def test_build_rejects_bad_calls(tiny_tokenizer, compile_json, kwargs, match):
    state = GrammarState(compile_json(tiny_tokenizer, OBJECT))
    builder = BitmaskBuilder(
        kwargs.get("vocab", tiny_tokenizer.vocab_size),
        max_num_seqs=2,
        num_speculative_tokens=kwargs.get("k", 2),
    )
    with pytest.raises(ValueError, match=match):
        builder.build([state] * kwargs.get("n", 1), kwargs.get("drafts"))
