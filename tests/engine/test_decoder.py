"""The greedy reference decoder, driven by the synthetic model."""

from __future__ import annotations

import pytest
import xgrammar as xgr

from gramcoord.engine.decoder import GreedyDecoder
from gramcoord.engine.models import ModelRequest, SyntheticModel
from gramcoord.rank_worker.errors import ErrorCode
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer
from gramcoord.rank_worker.masks.grammar_state import GrammarState

REFERENCE = '{"name": "Bob", "tags": ["a", "b"]}'


@pytest.mark.parametrize("k", [0, 2])
def test_decoder_follows_the_reference(qwen_tokenizer, compile_json, k):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "tags": {"type": "array"}},
        "required": ["name", "tags"],
    }
    compiled = compile_json(qwen_tokenizer, schema, any_whitespace=False)
    result = GreedyDecoder(qwen_tokenizer, num_speculative_tokens=k).decode(
        GrammarState(compiled),
        SyntheticModel(qwen_tokenizer),
        ModelRequest("r", reference=REFERENCE),
    )
    assert (result.text, result.finish_reason, result.error) == (REFERENCE, "grammar_end", None)
    assert result.token_ids[-1] in qwen_tokenizer.stop_ids
    assert result.num_steps == len(result.token_ids)


def test_decoder_stops_at_max_tokens(qwen_tokenizer, compile_json):
    compiled = compile_json(qwen_tokenizer, {"type": "string"})
    request = ModelRequest("r", reference='"' + "word " * 50 + '"')
    result = GreedyDecoder(qwen_tokenizer, max_tokens=7).decode(
        GrammarState(compiled), SyntheticModel(qwen_tokenizer), request
    )
    assert result.finish_reason == "length" and len(result.token_ids) == 7


def test_decoder_reports_a_dead_state():
    token_bytes = [b"a", b"b", b"</s>"]
    tok = Tokenizer(
        name="micro",
        token_bytes=token_bytes,
        special_ids={"</s>": 2},
        stop_ids=(2,),
        encoder=lambda text: [token_bytes.index(bytes([c])) for c in text.encode()],
    )
    compiled = xgr.GrammarCompiler(tok.info).compile_grammar('root ::= "a" "c"')
    result = GreedyDecoder(tok).decode(
        GrammarState(compiled), SyntheticModel(tok), ModelRequest("r", reference="ac")
    )
    assert result.finish_reason == "error"
    assert result.error is not None and result.error.code == ErrorCode.grammar_dead_state
    assert result.token_ids == [0]
