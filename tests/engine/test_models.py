"""Logits sources: the synthetic model and a tiny local Hugging Face model."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from gramcoord.engine.decoder import GreedyDecoder
from gramcoord.engine.models import (
    HFModel,
    ModelRequest,
    SyntheticModel,
    build_tiny_qwen2,
    make_model,
)
from gramcoord.rank_worker.config import ModelConfig
from gramcoord.rank_worker.masks.grammar_state import GrammarState

REFERENCE = '{"name": "Bob", "tags": ["a", "b"]}'


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------------------
# Synthetic


def test_synthetic_rows(qwen_tokenizer):
    model = SyntheticModel(qwen_tokenizer)
    request = ModelRequest("r", reference=REFERENCE)
    rows = model.logits([(request, []), (request, qwen_tokenizer.encode('{"name": "B'))])
    assert rows.dtype == torch.float32 and rows.shape == (2, qwen_tokenizer.vocab_size)
    assert model.vocab_size == qwen_tokenizer.vocab_size
    # On the reference, the longest continuing token wins.
    assert qwen_tokenizer.token_bytes[int(rows[1].argmax())] == b"ob"
    assert model.logits([]).shape == (0, qwen_tokenizer.vocab_size)


def test_synthetic_is_deterministic(qwen_tokenizer):
    rows = [
        (ModelRequest("a", reference=REFERENCE), qwen_tokenizer.encode('{"na')),
        (ModelRequest("b"), qwen_tokenizer.encode("{")),
        (ModelRequest("c", prompt_ids=(1, 2)), []),
    ]
    first = SyntheticModel(qwen_tokenizer, seed=7).logits(rows)
    same(first, SyntheticModel(qwen_tokenizer, seed=7).logits(rows))
    # Each row alone, and in another order, is the same row.
    for i, row in enumerate(rows):
        same(first[i], SyntheticModel(qwen_tokenizer, seed=7).logits([row])[0])
    same(first.flip(0), SyntheticModel(qwen_tokenizer, seed=7).logits(rows[::-1]))
    assert not torch.equal(first, SyntheticModel(qwen_tokenizer, seed=8).logits(rows))


def test_synthetic_is_keyed_by_text_not_tokens(qwen_tokenizer):
    model = SyntheticModel(qwen_tokenizer)
    canonical = qwen_tokenizer.encode('{"name": "B')
    split = [t for piece in ["{", '"na', 'me": "', "B"] for t in qwen_tokenizer.encode(piece)]
    assert canonical != split
    for request in (ModelRequest("r", reference=REFERENCE), ModelRequest("r")):
        rows = model.logits([(request, canonical), (request, split)])
        same(rows[0], rows[1])
    # The prompt is not part of the key.
    a = model.logits([(ModelRequest("r", prompt_ids=(1, 2, 3)), canonical)])
    same(a[0], model.logits([(ModelRequest("r"), canonical)])[0])


def test_synthetic_varies_by_request(qwen_tokenizer):
    model = SyntheticModel(qwen_tokenizer)
    ids = qwen_tokenizer.encode("{")
    rows = model.logits([(ModelRequest(f"req-{i}"), ids) for i in range(8)])
    assert len({tuple(row.topk(50).indices.tolist()) for row in rows}) > 1


@pytest.mark.parametrize(
    ("reference", "done"),
    [
        pytest.param(REFERENCE, REFERENCE, id="end-of-reference"),
        pytest.param(REFERENCE, "{x", id="off-reference"),
        pytest.param(None, '{"name": "B', id="no-reference"),
    ],
)
def test_synthetic_prefers_stopping(qwen_tokenizer, reference, done):
    model = SyntheticModel(qwen_tokenizer)
    row = model.logits([(ModelRequest("r", reference=reference), qwen_tokenizer.encode(done))])[0]
    assert int(row.argmax()) == qwen_tokenizer.eos_id
    if done != REFERENCE:
        closers = [qwen_tokenizer.encode(c)[0] for c in ("}", "]", '"')]
        assert all(row[c] > 20 for c in closers)


@pytest.mark.parametrize("any_whitespace", [False, True])
def test_synthetic_follows_the_reference_under_the_grammar(
    qwen_tokenizer, dev_pool, any_whitespace
):
    model = SyntheticModel(qwen_tokenizer)
    decoder = GreedyDecoder(qwen_tokenizer, max_tokens=512)
    for sid, compiled, text in dev_pool[any_whitespace][:6]:
        result = decoder.decode(GrammarState(compiled), model, ModelRequest(sid, reference=text))
        assert (result.text, result.finish_reason) == (text, "grammar_end"), sid
        assert result.token_ids[-1] == qwen_tokenizer.eos_id


def test_synthetic_without_reference_finishes(qwen_tokenizer, dev_pool):
    model = SyntheticModel(qwen_tokenizer)
    decoder = GreedyDecoder(qwen_tokenizer, max_tokens=256)
    texts = set()
    for sid, compiled, _ in dev_pool[True][:6]:
        for rid in (sid, sid + "-again"):
            result = decoder.decode(GrammarState(compiled), model, ModelRequest(rid))
            assert result.finish_reason == "grammar_end", (rid, result.text)
            texts.add(result.text)
    assert len(texts) > 6  # some requests of one schema differ


# ---------------------------------------------------------------------------
# Hugging Face


@pytest.fixture(scope="module")
def tiny(qwen_tokenizer):
    pytest.importorskip("transformers")
    return HFModel(build_tiny_qwen2(), vocab_size=qwen_tokenizer.vocab_size)


def test_missing_transformers_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"'hf' extra"):
        build_tiny_qwen2()
    with pytest.raises(ImportError, match=r"'hf' extra"):
        HFModel(tmp_path)


def hf_rows():
    return [
        (ModelRequest("a", prompt_ids=(100, 200, 300)), [5, 6]),
        (ModelRequest("b", prompt_ids=(100, 200, 300)), [5, 7]),
        (ModelRequest("c", prompt_ids=(9,)), []),
        (ModelRequest("d"), [1, 2, 3, 4, 5, 6, 7]),
        (ModelRequest("e"), []),  # nothing at all: fed the BOS
    ]


def test_hf_logits_shape_and_conditioning(tiny, qwen_tokenizer):
    rows = tiny.logits(hf_rows())
    assert rows.shape == (5, qwen_tokenizer.vocab_size) == (5, 151_936)
    assert rows.dtype == torch.float32 and torch.isfinite(rows).all()
    # Different last token -> different logits; same tokens, other id -> same.
    assert not torch.allclose(rows[0], rows[1])
    again = tiny.logits([(ModelRequest("z", prompt_ids=(100, 200)), [300, 5, 6])])
    same(again[0], rows[0])


def test_hf_rows_do_not_depend_on_the_batch(tiny):
    rows = hf_rows()
    batch = tiny.logits(rows)
    for i, row in enumerate(rows):
        same(batch[i], tiny.logits([row])[0])
    batched = HFModel(tiny.model, vocab_size=tiny.vocab_size, batch_rows=True, max_batch_tokens=16)
    torch.testing.assert_close(batched.logits(rows), batch, rtol=1e-4, atol=1e-5)


def test_hf_pads_or_truncates_the_vocabulary(tiny):
    rows = hf_rows()[:2]
    wide = HFModel(tiny.model, vocab_size=152_000).logits(rows)
    assert torch.isneginf(wide[:, 151_936:]).all()
    narrow = HFModel(tiny.model, vocab_size=1000).logits(rows)
    same(narrow, wide[:, :1000])
    assert HFModel(tiny.model).vocab_size == tiny.model.config.vocab_size


def test_tiny_qwen2_is_deterministic(tiny):
    rows = hf_rows()
    same(HFModel(build_tiny_qwen2()).logits(rows), tiny.logits(rows))
    assert not torch.equal(HFModel(build_tiny_qwen2(seed=1)).logits(rows), tiny.logits(rows))
    state = torch.random.get_rng_state()
    build_tiny_qwen2(seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched


def test_tiny_qwen2_saves_and_loads_by_path(tmp_path, tiny, qwen_tokenizer):
    build_tiny_qwen2(tmp_path / "tiny")
    config = ModelConfig(kind="hf", path=str(tmp_path / "tiny"))
    model = make_model(config, qwen_tokenizer)
    assert isinstance(model, HFModel)
    same(model.logits(hf_rows()), tiny.logits(hf_rows()))


def test_make_model_synthetic(qwen_tokenizer):
    model = make_model(ModelConfig(seed=3), qwen_tokenizer)
    assert isinstance(model, SyntheticModel) and model.seed == 3


def test_model_config_needs_a_path_for_hf():
    with pytest.raises(
        ValueError, match=re.escape("model.path is required when model.kind is 'hf'")
    ):
        ModelConfig(kind="hf")
