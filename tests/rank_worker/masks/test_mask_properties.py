"""Property tests over dev schemas with valid instances (real Qwen vocabulary).

- Any tokenization of a valid instance walks through the masks without ever
  hitting a masked token, and ends where EOS is allowed.
- Speculative rows equal the plain next-token masks at their positions, for
  any drafts (correct, corrupted, padded), and a build changes no state.
- Greedy outputs with K drafts from any drafter equal the K = 0 outputs.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gramcoord.engine.decoder import GreedyDecoder
from gramcoord.engine.drafter import NgramDrafter, ReplayDrafter
from gramcoord.engine.models import ModelRequest, SyntheticModel
from gramcoord.rank_worker.masks.bitmask import BitmaskBuilder, trim_drafts
from gramcoord.rank_worker.masks.gate import Gate
from gramcoord.rank_worker.masks.grammar_state import GrammarState, strip_padding

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


def allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def next_mask(builder: BitmaskBuilder, state: GrammarState) -> np.ndarray:
    result = builder.build([state])
    assert result.failures == {}
    return result.bitmask[0].copy()


def split_encode(tokenizer, text: str, cuts: list[int]) -> list[int]:
    """Encode ``text`` in pieces cut at ``cuts``: a valid, non-canonical
    tokenization (pieces may split UTF-8 characters only at char bounds)."""
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [t for a, b in itertools.pairwise(bounds) for t in tokenizer.encode(text[a:b])]


@SETTINGS
@given(
    whitespace=st.booleans(),
    index=st.integers(0, 1000),
    cuts=st.lists(st.integers(0, 10_000), max_size=6),
)
def test_instance_tokens_are_never_masked(qwen_tokenizer, dev_pool, whitespace, index, cuts):
    sid, compiled, text = dev_pool[whitespace][index % len(dev_pool[whitespace])]
    builder = BitmaskBuilder(qwen_tokenizer.vocab_size, max_num_seqs=1)
    state = GrammarState(compiled)
    for i, token in enumerate(split_encode(qwen_tokenizer, text, cuts)):
        row = next_mask(builder, state)
        assert allowed(row, token), f"{sid}: token {i} ({token}) masked"
        assert (
            not any(allowed(row, s) for s in qwen_tokenizer.stop_ids)
            or state.matcher.is_completed()
        )
        state.accept_tokens([token])
    row = next_mask(builder, state)
    assert allowed(row, qwen_tokenizer.eos_id), f"{sid}: EOS masked at the end"
    state.accept_tokens([qwen_tokenizer.eos_id])
    assert state.is_terminated


@settings(SETTINGS, max_examples=150)
@given(
    whitespace=st.booleans(),
    index=st.integers(0, 1000),
    position=st.integers(0, 10_000),
    k=st.integers(1, 4),
    corrupt=st.sampled_from(["none", "token", "padding", "eos"]),
    where=st.integers(0, 3),
    noise=st.integers(0, 151_935),
)
def test_speculative_rows_equal_plain_masks(
    qwen_tokenizer, dev_pool, whitespace, index, position, k, corrupt, where, noise
):
    sid, compiled, text = dev_pool[whitespace][index % len(dev_pool[whitespace])]
    tokens = [*qwen_tokenizer.encode(text), qwen_tokenizer.eos_id]
    p = position % len(tokens)
    drafts = tokens[p : p + k]
    if corrupt != "none" and drafts:
        j = where % len(drafts)
        drafts[j] = {"token": noise, "padding": -1, "eos": qwen_tokenizer.eos_id}[corrupt]
    state = GrammarState(compiled)
    state.accept_tokens(tokens[:p])
    plain = BitmaskBuilder(qwen_tokenizer.vocab_size, max_num_seqs=1)
    spec = BitmaskBuilder(qwen_tokenizer.vocab_size, max_num_seqs=1, num_speculative_tokens=k)

    before = (state.validate_tokens(drafts), state.num_tokens, next_mask(plain, state))
    rows = spec.build([state], [drafts]).bitmask
    validated = trim_drafts(state, drafts)
    assert validated == before[0]
    assert state.num_tokens == before[1]
    np.testing.assert_array_equal(next_mask(plain, state), before[2])

    for i in range(len(validated) + 1):
        state.accept_tokens(validated[:i])
        if state.is_terminated:
            assert (rows[i] == -1).all(), f"{sid}: row {i} after a stop token"
        else:
            np.testing.assert_array_equal(rows[i], next_mask(plain, state), err_msg=sid)
        state.rollback(i)
    assert (rows[len(validated) + 1 :] == -1).all()
    assert len(validated) <= len(strip_padding(drafts))


class RandomDrafter:
    """Any drafter: reference-correct tokens, random ids, and padding, mixed."""

    def __init__(self, reference: ReplayDrafter, rng: random.Random, vocab_size: int) -> None:
        self.reference = reference
        self.rng = rng
        self.vocab_size = vocab_size

    def propose(self, output, k):
        good = self.reference.propose(output, k)
        out = []
        for i in range(k):
            roll = self.rng.random()
            if roll < 0.6 and i < len(good):
                out.append(good[i])
            elif roll < 0.8:
                out.append(self.rng.randrange(self.vocab_size))
            else:
                out.append(-1)
        return out


_K0: dict[tuple, tuple] = {}


@settings(SETTINGS, max_examples=40)
@given(
    whitespace=st.booleans(),
    index=st.integers(0, 1000),
    k=st.integers(1, 4),
    kind=st.sampled_from(["replay", "ngram", "random"]),
    detour=st.sampled_from([None, 5, 17]),
    reasoning=st.booleans(),
    rng=st.randoms(use_true_random=False),
)
def test_greedy_outputs_do_not_depend_on_drafts(
    qwen_tokenizer, dev_pool, whitespace, index, k, kind, detour, reasoning, rng
):
    sid, compiled, text = dev_pool[whitespace][index % len(dev_pool[whitespace])]
    end = qwen_tokenizer.special_ids["</tool_call>"]
    # A detour makes the model leave the valid text and improvise.
    reference = text if detour is None else text[:detour] + "\u00a7" + text[detour:]
    if reasoning:
        reference = "Let me think</tool_call>" + reference
    model = SyntheticModel(qwen_tokenizer)
    request = ModelRequest(sid, reference=reference)
    gate = Gate(think_end_ids=[end]) if reasoning else None

    key = (whitespace, sid, detour, reasoning)
    if key not in _K0:
        plain = GreedyDecoder(qwen_tokenizer, max_tokens=96)
        _K0[key] = plain.decode(GrammarState(compiled, gate=gate), model, request)
    expected = _K0[key]

    drafter = {
        "replay": lambda: ReplayDrafter(qwen_tokenizer, reference, request_id=sid),
        "ngram": lambda: NgramDrafter(qwen_tokenizer.encode(reference)),
        "random": lambda: RandomDrafter(
            ReplayDrafter(qwen_tokenizer, reference, error_every=0),
            rng,
            qwen_tokenizer.vocab_size,
        ),
    }[kind]()
    spec = GreedyDecoder(qwen_tokenizer, num_speculative_tokens=k, max_tokens=96)
    got = spec.decode(GrammarState(compiled, gate=gate), model, request, drafter)
    assert got.token_ids == expected.token_ids, sid
    assert got.finish_reason == expected.finish_reason
    assert (got.error and got.error.code) == (expected.error and expected.error.code)
    assert got.num_steps <= expected.num_steps
    if detour is None and expected.finish_reason != "length":
        # Followed to its end, the instance is the output (a long one runs
        # into max_tokens first).
        assert expected.text.endswith(text), sid


@pytest.mark.parametrize("kind", ["replay", "ngram"])
def test_drafts_save_steps(qwen_tokenizer, dev_pool, kind):
    sid, compiled, text = dev_pool[False][0]
    model = SyntheticModel(qwen_tokenizer)
    request = ModelRequest(sid, reference=text)
    drafter = (
        ReplayDrafter(qwen_tokenizer, text, request_id=sid)
        if kind == "replay"
        else NgramDrafter(qwen_tokenizer.encode(text))
    )
    plain = GreedyDecoder(qwen_tokenizer).decode(GrammarState(compiled), model, request)
    spec = GreedyDecoder(qwen_tokenizer, num_speculative_tokens=3).decode(
        GrammarState(compiled), model, request, drafter
    )
    assert spec.token_ids == plain.token_ids
    assert spec.num_steps < plain.num_steps, sid
