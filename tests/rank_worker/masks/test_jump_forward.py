"""Jump-forward: forced text without model steps, the exact mode's safe
prefix, greedy retokenization at the boundary, and identical outputs on the
dev schemas (more in ``test_jump_identity.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import xgrammar as xgr

from gramcoord.engine.decoder import GreedyDecoder
from gramcoord.engine.models import ModelRequest, SyntheticModel
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer
from gramcoord.rank_worker.masks.gate import Gate
from gramcoord.rank_worker.masks.grammar_state import GrammarState
from gramcoord.rank_worker.masks.jump_forward import JumpForward, retokenize_plan

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
ALPHABET = {"enum": ["alphabet"]}
CLEF = {"enum": ["\U0001d11exyz"]}
A, B, C, D, E = 11, 12, 13, 14, 15


@pytest.mark.parametrize(
    ("old", "new", "rollback", "suffix"),
    [
        pytest.param([A, B, C], [A, D], 2, [D], id="merge"),
        pytest.param([A, B], [A, B, C], 0, [C], id="append"),
        pytest.param([A, B], [C], 2, [C], id="replace-all"),
        pytest.param([], [A, B], 0, [A, B], id="empty-window"),
        pytest.param([A, B], [A, B], 0, [], id="nothing-new"),
        pytest.param([A, B, C], [A, B, D, E], 1, [D, E], id="split"),
    ],
)
def test_retokenize_plan(old, new, rollback, suffix):
    assert retokenize_plan(old, new) == (rollback, suffix)


def mask(state: GrammarState) -> np.ndarray:
    row = np.zeros((1, (state.vocab_size + 31) // 32), dtype=np.int32)
    state.fill_row(row, 0)
    return row[0]


def assert_same_state(state: GrammarState, compiled, output: list[int]) -> None:
    """``state`` must equal a fresh state that accepted ``output`` directly."""
    direct = GrammarState(compiled)
    direct.accept_tokens(output)
    np.testing.assert_array_equal(mask(state), mask(direct))
    assert state.matcher.find_jump_forward_string() == direct.matcher.find_jump_forward_string()
    assert state.matcher.is_completed() == direct.matcher.is_completed()


@pytest.mark.parametrize(
    ("schema", "prefix", "window", "rollback", "text"),
    [
        pytest.param(PERSON, "", 4, 0, '{"name": "', id="object-start"),
        pytest.param(PERSON, '{"name": "Al", "age', 4, 0, '{"name": "Al", "age": ', id="key"),
        pytest.param(ALPHABET, '"al', 4, 1, '"alphabet"', id="merge-with-tail"),
        pytest.param(ALPHABET, '"al|ph', 4, 2, '"alphabet"', id="merge-two"),
        pytest.param(CLEF, '"\U0001d11ex', 2, 1, '"\U0001d11exyz"', id="window-not-utf8"),
    ],
)
def test_jump_emits_forced_text_and_matches_direct_acceptance(
    qwen_tokenizer, compile_json, schema, prefix, window, rollback, text
):
    compiled = compile_json(qwen_tokenizer, schema, any_whitespace=False)
    state = GrammarState(compiled)
    # "|" separates pieces the model emitted as separate tokens.
    output = [t for part in prefix.split("|") if part for t in qwen_tokenizer.encode(part)]
    state.accept_tokens(output)
    jf = JumpForward(qwen_tokenizer, mode="greedy", window=window)
    result = jf.jump(state, output)
    assert result is not None
    assert result.num_rollback == rollback
    assert qwen_tokenizer.decode(output) == text
    assert_same_state(state, compiled, output)
    assert jf.stats.num_jumps == 1
    assert jf.stats.num_steps_saved == max(0, len(result.tokens) - rollback)
    # Nothing more is forced right after a jump.
    assert jf.plan(state, output) is None


def test_nothing_to_jump(qwen_tokenizer, compile_json):
    jf = JumpForward(qwen_tokenizer)
    free = GrammarState(compile_json(qwen_tokenizer, {"type": "object"}))
    output = qwen_tokenizer.encode("{")
    free.accept_tokens(output)
    assert jf.jump(free, output) is None, "'}', '\"' and whitespace may follow"
    gated = GrammarState(
        compile_json(qwen_tokenizer, PERSON, any_whitespace=False),
        gate=Gate(think_end_ids=[qwen_tokenizer.special_ids["</tool_call>"]]),
    )
    assert jf.jump(gated, []) is None, "no jump while reasoning"
    assert jf.stats.num_jumps == 0


def test_window_stops_at_the_constraint_start(qwen_tokenizer, compile_json):
    end = qwen_tokenizer.special_ids["</tool_call>"]
    compiled = compile_json(qwen_tokenizer, PERSON, any_whitespace=False)
    state = GrammarState(compiled, gate=Gate(think_end_ids=[end]))
    output = [*qwen_tokenizer.encode("hmm"), end]
    state.accept_tokens(output)
    result = JumpForward(qwen_tokenizer, mode="greedy").jump(state, output)
    assert result is not None and result.num_rollback == 0
    assert output[: len(output) - len(result.tokens)] == [*qwen_tokenizer.encode("hmm"), end]
    assert qwen_tokenizer.decode(result.tokens) == '{"name": "'


@pytest.mark.parametrize(("enabled", "expected"), [(True, JumpForward), (False, type(None))])
def test_config_switch(qwen_tokenizer, enabled, expected):
    config = GrammarConfig(jump_forward=enabled)
    assert isinstance(JumpForward.from_config(config, qwen_tokenizer), expected)


@pytest.mark.parametrize("mode", ["exact", "greedy"])
def test_config_mode(qwen_tokenizer, mode):
    assert GrammarConfig().jump_forward_mode == "exact"
    config = GrammarConfig(jump_forward=True, jump_forward_mode=mode)
    assert JumpForward.from_config(config, qwen_tokenizer).mode == mode


def test_bad_arguments(qwen_tokenizer):
    with pytest.raises(ValueError, match="mode"):
        JumpForward(qwen_tokenizer, mode="fast")
    with pytest.raises(ValueError, match="hold_back"):
        JumpForward(qwen_tokenizer, hold_back=True)
    with pytest.raises(ValueError, match="max_scan_bytes"):
        JumpForward(qwen_tokenizer, max_scan_bytes=0)


@pytest.mark.parametrize("mode", ["exact", "greedy"])
def test_dev_schemas_same_text_fewer_steps(qwen_tokenizer, dev_pool, mode):
    """Outputs that follow a valid reference are the same text with and
    without jump-forward; the forced text costs no model step."""
    plain = GreedyDecoder(qwen_tokenizer)
    model = SyntheticModel(qwen_tokenizer)
    steps = {False: 0, True: 0}
    for sid, compiled, text in dev_pool[False][:12]:
        request = ModelRequest(sid, reference=text)
        jf = JumpForward(qwen_tokenizer, mode=mode)
        with_jf = GreedyDecoder(qwen_tokenizer, jump_forward=jf)
        a = plain.decode(GrammarState(compiled), model, request)
        b = with_jf.decode(GrammarState(compiled), model, request)
        assert a.finish_reason == b.finish_reason == "grammar_end", sid
        assert a.text == b.text == text, sid
        assert b.num_steps <= a.num_steps, sid
        assert b.num_steps_saved == jf.stats.num_steps_saved
        steps[False] += a.num_steps
        steps[True] += b.num_steps
    assert steps[True] < steps[False]


def test_hold_back_leaves_an_extensible_last_token(qwen_tokenizer, compile_json):
    compiled = compile_json(qwen_tokenizer, PERSON, any_whitespace=False)
    state = GrammarState(compiled)
    output: list[int] = []
    jf = JumpForward(qwen_tokenizer, mode="greedy", hold_back=True)
    result = jf.jump(state, output)
    assert result is not None
    # ' "' could merge with the value's first characters: left to the model.
    assert qwen_tokenizer.decode(output) == '{"name":'
    assert_same_state(state, compiled, output)
    assert jf.plan(state, output) is None


def greedy_tokenizer(pieces: list[str | bytes]) -> Tokenizer:
    """Bytes plus ``pieces``, encoded greedily longest-first; one stop."""
    extra = [p if isinstance(p, bytes) else p.encode() for p in pieces]
    token_bytes = [bytes([i]) for i in range(256)] + extra + [b"</s>"]
    index = {b: i for i, b in enumerate(token_bytes[:-1])}
    longest = max(len(b) for b in token_bytes)

    def encode(text: str) -> list[int]:
        data, out, i = text.encode(), [], 0
        while i < len(data):
            n = next(
                n for n in range(min(longest, len(data) - i), 0, -1) if data[i : i + n] in index
            )
            out.append(index[data[i : i + n]])
            i += n
        return out

    stop = len(token_bytes) - 1
    return Tokenizer(
        name="greedy",
        token_bytes=token_bytes,
        special_ids={"</s>": stop},
        stop_ids=(stop,),
        encoder=encode,
    )


def test_hold_back_never_gives_back_emitted_text():
    tok = greedy_tokenizer(["alph", "alphabet", "alphabets"])
    compiled = xgr.GrammarCompiler(tok.info).compile_grammar('root ::= "alphabet" [0-9]')
    state = GrammarState(compiled)
    output = tok.encode("alph")
    state.accept_tokens(output)
    # 'alphabet' spans the emitted 'alph' and is extended by 'alphabets':
    # holding it back would take 'alph' away again.
    result = JumpForward(tok, mode="greedy", hold_back=True).jump(state, output)
    assert result is not None and result.num_rollback == 1
    assert output == tok.encode("alphabet")
    assert_same_state(state, compiled, output)


# -- exact mode ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("grammar", "pieces", "jumped"),
    [
        pytest.param('"abcd" [0-9]', [], "abcd", id="bytes-only"),
        pytest.param('"abcd" [0-9]', ["bc"], "abcd", id="inside-token"),
        # "abc" spans 1 and 2, "bcd" spans 3; nothing runs past the end.
        pytest.param('"abcd" [0-9]', ["abc", "bcd"], "abcd", id="later-boundary-safe"),
        # "d1" runs past the end from offset 3: only boundaries <= 3.
        pytest.param('"abcd" [0-9]', ["d1"], "abc", id="merge-at-end"),
        pytest.param('"abcd" [0-9]', ["ab", "cd1"], "ab", id="merge-from-inside"),
        pytest.param('"abcd" [0-9]', ["abc", "bcd", "d1"], None, id="no-safe-boundary"),
        pytest.param('"abcd" [0-9]', ["abcd5"], None, id="merge-from-start"),
        # "é" is c3 a9: a boundary between them is never jumped to.
        pytest.param('"x\u00e9" [0-9]', [b"\xa91"], "x", id="utf8-merge-at-end"),
        pytest.param('"x\u00e9" [0-9]', [b"x\xc3", b"\xa91"], None, id="utf8-inside-char"),
        pytest.param('"x\u00e9" [0-9]', [b"x\xc3"], "x\u00e9", id="utf8-token-across"),
    ],
)
def test_exact_jumps_the_largest_safe_prefix(grammar, pieces, jumped):
    tok = greedy_tokenizer(pieces)
    compiled = xgr.GrammarCompiler(tok.info).compile_grammar(f"root ::= {grammar}")
    state = GrammarState(compiled)
    jf = JumpForward(tok)
    forced = state.matcher.find_jump_forward_string()
    assert forced == grammar.split('"')[1]
    output: list[int] = []
    result = jf.jump(state, output)
    if jumped is None:
        assert result is None and output == []
        assert jf.stats.num_forced_bytes_left == len(forced.encode())
        return
    assert result is not None
    assert (result.num_rollback, result.forced) == (0, jumped)
    assert output == tok.encode(jumped)
    assert_same_state(state, compiled, output)
    assert jf.stats.num_forced_bytes_left == len(forced.encode()) - len(jumped.encode())
    assert jf.plan(state, output) is None, "the largest safe boundary was taken"


def test_exact_scan_limit():
    tok = greedy_tokenizer([])
    compiled = xgr.GrammarCompiler(tok.info).compile_grammar('root ::= "abcdef" [0-9]')
    state = GrammarState(compiled)
    output: list[int] = []
    jf = JumpForward(tok, max_scan_bytes=2)
    assert jf.jump(state, output).forced == "ab"
    assert jf.jump(state, output).forced == "cd"


@pytest.mark.parametrize(
    ("schema", "prefix", "jumped"),
    [
        # ' "' is left: tokens such as ' "$' merge it with the value.
        pytest.param(PERSON, "", '{"name":', id="object-start"),
        pytest.param(PERSON, '{"name": "Al", "age', '":', id="key"),
        # The example: at '[[{' the model may pick '}],'.
        pytest.param(
            {
                "type": "array",
                "items": False,
                "prefixItems": [{"type": "array", "items": False, "prefixItems": [{}, {}]}],
            },
            "[[",
            None,
            id="bracket-merge",
        ),
        pytest.param(ALPHABET, '"al', 'phabet"', id="enum"),
    ],
)
def test_exact_on_qwen_never_retokenizes(qwen_tokenizer, compile_json, schema, prefix, jumped):
    compiled = compile_json(qwen_tokenizer, schema, any_whitespace=False)
    state = GrammarState(compiled)
    output = qwen_tokenizer.encode(prefix)
    state.accept_tokens(output)
    before = list(output)
    jf = JumpForward(qwen_tokenizer)
    result = jf.jump(state, output)
    if jumped is None:
        assert result is None and output == before
        return
    assert result.num_rollback == 0 and result.forced == jumped
    assert output == before + qwen_tokenizer.encode(jumped)
    assert_same_state(state, compiled, output)
    assert jf.stats.num_tokens_replaced == 0


def _dup_vocab() -> Tokenizer:
    """Ids 2 and 5 spell ``ab``; 7 and 8 are specials (8 a stop); 6 is padding."""
    spelled = [b"a", b"b", b"ab", b"abc", b"b\xff", b"ab", b"", b"<s>", b"</s>"]
    return Tokenizer(
        name="dup",
        token_bytes=spelled,
        special_ids={"<s>": 7, "</s>": 8},
        stop_ids=(8,),
        encoder=None,
    )


def test_the_exact_scan_table_lists_every_spelling_once_with_its_ids_in_order():
    from gramcoord.rank_worker.masks.jump_forward import _Vocab

    table = _Vocab(_dup_vocab())
    assert table._keys == sorted({b"a", b"b", b"ab", b"abc", b"b\xff", b"<s>", b"</s>"})
    ids = {k: table._flat[table._offsets[r] : table._offsets[r + 1]].tolist() for k, r in
           table._rank.items()}  # fmt: skip
    assert ids[b"ab"] == [2, 5] and ids[b"a"] == [0] and ids[b"</s>"] == [8]
    assert table._max_len == 4
    (offset,) = table.layout(b"ab", 1)
    assert [(n, i.tolist()) for n, i in offset.inside] == [(2, [2, 5]), (1, [0])]
    assert offset.past.tolist() == [3]  # "abc" runs past the forced "ab"


def test_the_synthetic_index_keeps_the_first_id_and_no_stop():
    from gramcoord.engine.models import vocab_index

    index, longest = vocab_index(_dup_vocab())
    assert index[b"ab"] == 2 and b"</s>" not in index and index[b"<s>"] == 7
    assert b"" not in index and longest == 3  # "</s>" (4 bytes) is a stop


def test_a_vocabulary_builds_its_encoder_and_full_info_on_first_use():
    from gramcoord.rank_worker.grammars import tokenizer as tk

    tok = tk._load_qwen("qwen2.5", 0)
    assert tok._full_info is None and tok._encoder._encode is None
    assert tok.encode("hello world") == [14990, 1879]
    assert tok.full_info.decoded_vocab[151644] == b"<|im_start|>"
    assert tok.info.decoded_vocab[151644] == b""  # a special outside constrained text
    assert tok.max_token_bytes == max(len(t) for t in tok.token_bytes[:151643])
