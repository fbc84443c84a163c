"""The greedy reference decoder and its deterministic replay model."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from gramcoord.rank_worker.engine.decoder import GreedyDecoder
from gramcoord.rank_worker.engine.replay_model import ReplayModel
from gramcoord.rank_worker.errors import ErrorCode
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer
from gramcoord.rank_worker.masks.grammar_state import GrammarState

REFERENCE = '{"name": "Bob", "tags": ["a", "b"]}'


def test_replay_model_is_keyed_by_text(qwen_tokenizer):
    model = ReplayModel(qwen_tokenizer, REFERENCE)
    canonical = qwen_tokenizer.encode('{"name": "B')
    split = [t for piece in ["{", '"na', 'me": "', "B"] for t in qwen_tokenizer.encode(piece)]
    assert canonical != split
    rows = model.logits([canonical, split, canonical])
    assert rows.dtype == torch.float32 and rows.shape == (3, qwen_tokenizer.vocab_size)
    torch.testing.assert_close(rows[0], rows[1], rtol=0, atol=0)
    torch.testing.assert_close(
        rows[0], ReplayModel(qwen_tokenizer, REFERENCE).logits([canonical])[0]
    )
    # On the reference, the longest continuing token wins.
    assert qwen_tokenizer.token_bytes[int(rows[0].argmax())] == b"ob"


@pytest.mark.parametrize(
    ("done", "best"),
    [
        pytest.param(REFERENCE, "stop", id="end-of-reference"),
        pytest.param("{x", "closer", id="off"),
    ],
)
def test_replay_model_ends_and_closes(qwen_tokenizer, done, best):
    row = ReplayModel(qwen_tokenizer, REFERENCE).logits([qwen_tokenizer.encode(done)])[0]
    top = int(row.argmax())
    if best == "stop":
        assert top in qwen_tokenizer.stop_ids
    else:
        assert top in qwen_tokenizer.stop_ids  # off the reference, stopping ranks first
        closers = [qwen_tokenizer.encode(c)[0] for c in ("}", "]", '"')]
        assert all(row[c] > 20 for c in closers)


@pytest.mark.parametrize("k", [0, 2])
def test_decoder_follows_the_reference(qwen_tokenizer, compile_json, k):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "tags": {"type": "array"}},
        "required": ["name", "tags"],
    }
    compiled = compile_json(qwen_tokenizer, schema, any_whitespace=False)
    result = GreedyDecoder(qwen_tokenizer, num_speculative_tokens=k).decode(
        GrammarState(compiled), ReplayModel(qwen_tokenizer, REFERENCE)
    )
    assert (result.text, result.finish_reason, result.error) == (REFERENCE, "stop", None)
    assert result.token_ids[-1] in qwen_tokenizer.stop_ids
    assert result.num_steps == len(result.token_ids)


def test_decoder_stops_at_max_tokens(qwen_tokenizer, compile_json):
    compiled = compile_json(qwen_tokenizer, {"type": "string"})
    model = ReplayModel(qwen_tokenizer, '"' + "word " * 50 + '"')
    result = GreedyDecoder(qwen_tokenizer, max_tokens=7).decode(GrammarState(compiled), model)
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
    result = GreedyDecoder(tok).decode(GrammarState(compiled), ReplayModel(tok, "ac"))
    assert result.finish_reason == "error"
    assert result.error is not None and result.error.code == ErrorCode.grammar_dead_state
    assert result.token_ids == [0]
