"""The real vocabularies as xgrammar sees them."""

from __future__ import annotations

import pytest

from gramcoord.rank_worker.config import TokenizerConfig
from gramcoord.rank_worker.grammars.tokenizer import TokenizerError, load_tokenizer


@pytest.mark.parametrize(
    ("name", "size", "stops", "first_special"),
    [
        pytest.param("qwen2.5", 151_936, (151645, 151643), 151643, id="qwen2.5"),
        pytest.param("qwen3.6", 248_320, (248046, 248044), 248044, id="qwen3.6"),
    ],
)
def test_vocab_shape(name, size, stops, first_special):
    tok = load_tokenizer(TokenizerConfig(name=name))
    assert tok.vocab_size == tok.info.vocab_size == size
    assert tok.stop_ids == stops
    assert sorted(tok.info.stop_token_ids) == sorted(stops)
    assert min(tok.special_ids.values()) == first_special
    # Non-stop specials are empty in the restricted view (never allowed),
    # and keep their text in the full view.
    non_stop = [i for i in tok.special_ids.values() if i not in stops]
    assert all(i in set(tok.info.special_token_ids) for i in non_stop)
    assert tok.full_info.decoded_vocab[non_stop[0]] == tok.token_bytes[non_stop[0]] != b""


@pytest.mark.parametrize(
    "text",
    [
        pytest.param('{"name": "Ünïcødé ✓", "n": [1, 2.5e-3]}', id="json"),
        pytest.param("<|im_start|> is plain text here", id="special-text"),
        pytest.param("  leading and trailing  \n", id="whitespace"),
    ],
)
def test_round_trip(qwen_tokenizer, text):
    ids = qwen_tokenizer.encode(text)
    assert qwen_tokenizer.decode(ids) == text
    assert all(i < 151643 for i in ids)  # specials are never produced from text


def test_loaded_once(qwen_tokenizer):
    assert load_tokenizer(TokenizerConfig(name="qwen2.5")) is qwen_tokenizer


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        pytest.param(
            TokenizerConfig(name="hf", path="/nonexistent/dir"),
            "not a local directory",
            id="hf-missing",
        ),
        pytest.param(
            TokenizerConfig(name="qwen2.5", vocab_size=1000), "smaller", id="vocab-too-small"
        ),
    ],
)
def test_bad_config(config, needle):
    with pytest.raises(TokenizerError, match=needle):
        load_tokenizer(config)


def test_hf_tokenizer_from_local_dir(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4, "{": 5, "}": 6}
    core = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(tmp_path)
    tok = load_tokenizer(TokenizerConfig(name="hf", path=str(tmp_path), vocab_size=64))
    assert tok.vocab_size == 64 and tok.eos_id == 1
    assert tok.token_bytes[4] == b"ab"
    assert tok.encode("ab") == [4]
