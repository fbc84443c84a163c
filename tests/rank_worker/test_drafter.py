"""Draft proposers: n-gram lookup, reference replay, and the config factory."""

from __future__ import annotations

import pytest

from gramcoord.rank_worker.config import SpeculativeConfig
from gramcoord.rank_worker.engine.drafter import NgramDrafter, ReferenceDrafter, make_drafter


@pytest.mark.parametrize(
    ("prompt", "output", "k", "drafts"),
    [
        pytest.param([1, 2, 3, 4], [1, 2], 2, [3, 4], id="prompt-lookup"),
        pytest.param([], [5, 6, 7, 5, 6], 3, [7, 5, 6], id="output-lookup"),
        pytest.param([1, 2, 9, 1, 2, 8], [1, 2], 1, [8], id="most-recent-match"),
        pytest.param([1, 2, 3, 8, 5, 2, 3, 9], [1, 2, 3], 1, [8], id="longest-suffix-first"),
        pytest.param([1, 2, 3], [4], 2, [], id="no-match"),
        pytest.param([1, 2, 3], [1], 0, [], id="k-zero"),
        pytest.param([], [], 2, [], id="empty"),
    ],
)
def test_ngram(prompt, output, k, drafts):
    assert NgramDrafter(prompt).propose(output, k) == drafts


def test_ngram_rejects_bad_sizes():
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(min_n=3, max_n=2)


@pytest.mark.parametrize(
    ("done", "k", "expected"),
    [
        pytest.param("", 3, "canonical-start", id="start"),
        pytest.param('{"name', 2, "canonical-boundary", id="on-a-token-boundary"),
        pytest.param('{"na', 2, "re-encoded", id="inside-a-token"),
        pytest.param('{"nope', 2, "off", id="off-reference"),
        pytest.param('{"name": "Bob"}', 2, "end", id="finished"),
    ],
)
def test_reference_drafter(qwen_tokenizer, done, k, expected):
    reference = '{"name": "Bob"}'
    drafter = ReferenceDrafter(qwen_tokenizer, reference)
    output = qwen_tokenizer.encode(done)
    drafts = drafter.propose(output, k)
    canonical = qwen_tokenizer.encode(reference)
    if expected in ("off", "end"):
        assert drafts == []
    else:
        assert len(drafts) == k
        assert reference.encode().startswith(qwen_tokenizer.decode_bytes(output + drafts))
        if expected.startswith("canonical"):
            start = len(output)
            assert canonical[:start] == output and drafts == canonical[start : start + k]


@pytest.mark.parametrize(
    ("config", "reference", "kind"),
    [
        pytest.param(SpeculativeConfig(), "x", type(None), id="k-zero"),
        pytest.param(SpeculativeConfig(num_tokens=2), "x", type(None), id="drafter-none"),
        pytest.param(
            SpeculativeConfig(num_tokens=2, drafter="ngram"), "x", NgramDrafter, id="ngram"
        ),
        pytest.param(
            SpeculativeConfig(num_tokens=2, drafter="reference"),
            "x",
            ReferenceDrafter,
            id="reference",
        ),
        pytest.param(
            SpeculativeConfig(num_tokens=2, drafter="reference"),
            None,
            NgramDrafter,
            id="reference-without-text",
        ),
    ],
)
def test_make_drafter(qwen_tokenizer, config, reference, kind):
    drafter = make_drafter(config, tokenizer=qwen_tokenizer, prompt=[1, 2], reference=reference)
    assert isinstance(drafter, kind)
