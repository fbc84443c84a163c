"""Draft proposers: n-gram lookup, reference replay with errors, and the config factory."""

from __future__ import annotations

import pytest

from gramcoord.engine.drafter import NgramDrafter, ReplayDrafter, make_drafter
from gramcoord.engine.models import ModelRequest
from gramcoord.rank_worker.config import SpeculativeConfig


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


REFERENCE = '{"name": "Bob", "tags": ["alpha", "beta"], "age": 42, "city": "Zürich"}'


def exact(tokenizer, reference=REFERENCE):
    return ReplayDrafter(tokenizer, reference, error_every=0)


@pytest.mark.parametrize(
    ("done", "k", "expected"),
    [
        pytest.param("", 3, "canonical", id="start"),
        pytest.param('{"name', 2, "canonical", id="on-a-token-boundary"),
        pytest.param('{"na', 2, "spells", id="inside-a-token"),
        pytest.param(
            '{"name": "Bob", "tags": ["alpha", "beta"], "age": 42, "city": "Z\u00fc',
            2,
            "spells",
            id="after-a-multibyte-character",
        ),
        pytest.param('{"nope', 2, "off", id="off-reference"),
        pytest.param(REFERENCE, 2, "end", id="finished"),
    ],
)
def test_exact_replay(qwen_tokenizer, done, k, expected):
    output = qwen_tokenizer.encode(done)
    drafts = exact(qwen_tokenizer).propose(output, k)
    canonical = qwen_tokenizer.encode(REFERENCE)
    if expected == "off":
        assert drafts == []
    elif expected == "end":
        assert drafts == [qwen_tokenizer.eos_id]
    else:
        assert len(drafts) == k
        assert REFERENCE.encode().startswith(qwen_tokenizer.decode_bytes(output + drafts))
        if expected == "canonical":
            start = len(output)
            assert canonical[:start] == output and drafts == canonical[start : start + k]


def test_exact_replay_inside_a_character(qwen_tokenizer):
    # "ü" split into its two bytes by the output: the drafts resume mid-character.
    head = REFERENCE.encode()[: REFERENCE.encode().index("ü".encode()) + 1]
    output = [
        *qwen_tokenizer.encode(head[:-1].decode()),
        qwen_tokenizer.token_bytes.index(head[-1:]),
    ]
    drafts = exact(qwen_tokenizer).propose(output, 3)
    assert len(drafts) == 3
    assert REFERENCE.encode().startswith(qwen_tokenizer.decode_bytes(output + drafts))


def test_exact_replay_ends_with_the_stop_token(qwen_tokenizer):
    canonical = qwen_tokenizer.encode(REFERENCE)
    drafts = exact(qwen_tokenizer).propose(canonical[:-2], 5)
    assert drafts == [*canonical[-2:], qwen_tokenizer.eos_id]


def walk(tokenizer, drafter, k):
    """Propose k drafts at every canonical position; count right and wrong ones."""
    canonical = [*tokenizer.encode(REFERENCE), tokenizer.eos_id]
    right = wrong = 0
    for p in range(len(canonical)):
        drafts = drafter.propose(canonical[:p], k)
        assert 1 <= len(drafts) <= k
        if drafts[0] == canonical[p]:
            right += 1
        else:
            wrong += 1
    return right, wrong


def test_replay_makes_deliberate_errors(qwen_tokenizer):
    drafter = ReplayDrafter(qwen_tokenizer, REFERENCE, request_id="req-1")
    right, wrong = walk(qwen_tokenizer, drafter, 1)
    assert right > 0 and wrong > 0
    assert right > wrong  # about one in four is wrong
    assert walk(qwen_tokenizer, exact(qwen_tokenizer), 1) == (right + wrong, 0)


def test_replay_errors_are_deterministic_and_keyed_by_request(qwen_tokenizer):
    canonical = qwen_tokenizer.encode(REFERENCE)

    def proposals(request_id):
        drafter = ReplayDrafter(qwen_tokenizer, REFERENCE, request_id=request_id)
        return [drafter.propose(canonical[:p], 3) for p in range(len(canonical))]

    assert proposals("a") == proposals("a")
    assert proposals("a") != proposals("b")


def test_replay_errors_are_both_kinds(qwen_tokenizer):
    """Some wrong drafts still spell the reference (the model rejects them),
    others do not (the grammar usually trims them)."""
    canonical = qwen_tokenizer.encode(REFERENCE)
    spelling = unrelated = 0
    for rid in ("a", "b", "c", "d"):
        drafter = ReplayDrafter(qwen_tokenizer, REFERENCE, request_id=rid)
        for p in range(len(canonical)):
            draft = drafter.propose(canonical[:p], 1)[0]
            if draft == canonical[p]:
                continue
            if REFERENCE.encode().startswith(qwen_tokenizer.decode_bytes([*canonical[:p], draft])):
                spelling += 1
            else:
                unrelated += 1
    assert spelling > 0 and unrelated > 0


def test_replay_rejects_a_negative_period(qwen_tokenizer):
    with pytest.raises(ValueError, match="error_every"):
        ReplayDrafter(qwen_tokenizer, "x", error_every=-1)


@pytest.mark.parametrize(
    ("config", "reference", "kind"),
    [
        pytest.param(SpeculativeConfig(), "x", type(None), id="k-zero"),
        pytest.param(
            SpeculativeConfig(num_tokens=0, drafter="replay"), "x", type(None), id="k-zero-replay"
        ),
        pytest.param(SpeculativeConfig(num_tokens=2), "x", NgramDrafter, id="default-ngram"),
        pytest.param(
            SpeculativeConfig(num_tokens=2, drafter="replay"), "x", ReplayDrafter, id="replay"
        ),
        pytest.param(
            SpeculativeConfig(num_tokens=2, drafter="replay"),
            None,
            NgramDrafter,
            id="replay-without-text",
        ),
    ],
)
def test_make_drafter(qwen_tokenizer, config, reference, kind):
    request = ModelRequest("r", prompt_ids=(1, 2, 1), reference=reference)
    drafter = make_drafter(config, qwen_tokenizer, request)
    assert isinstance(drafter, kind)
    if isinstance(drafter, NgramDrafter):
        assert drafter.propose([], 1) == [2]  # looks up the request's prompt
    if isinstance(drafter, ReplayDrafter):
        assert drafter.request_id == "r"
