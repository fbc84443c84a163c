"""The sampler: greedy argmax, and seeded sampling keyed by (seed, request, position)."""

from __future__ import annotations

import collections
import math

import msgspec
import pytest
import torch

from gramcoord.engine.sampler import Sampler, uniform_bits
from gramcoord.rank_worker.config import SamplingConfig

V = 151_936
NEG = float("-inf")


def masked_logits(n: int, vocab: int = V, *, seed: int = 0, keep: float = 0.3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[torch.rand(n, vocab, generator=g) > keep] = NEG
    return logits


def keys(n: int, start: int = 0) -> list[tuple[str, int]]:
    return [(f"req-{i % 5}", start + i) for i in range(n)]


def test_config():
    assert SamplingConfig() == SamplingConfig(temperature=0.0, seed=0)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"temperature": -0.5}, SamplingConfig)


def test_greedy_is_argmax():
    logits = masked_logits(16)
    picks = Sampler(SamplingConfig()).sample(logits, keys(16))
    assert picks == logits.argmax(dim=-1).tolist()
    # Ties go to the lowest id.
    tie = torch.full((1, 10), NEG)
    tie[0, [3, 7]] = 1.0
    assert Sampler(SamplingConfig()).sample(tie, [("r", 0)]) == [3]


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 5.0])
def test_same_picks_whatever_the_batch(temperature):
    sampler = Sampler(SamplingConfig(temperature=temperature, seed=11))
    logits, k = masked_logits(24), keys(24)
    picks = sampler.sample(logits, k)
    assert picks == sampler.sample(logits, k)
    assert picks == Sampler(SamplingConfig(temperature=temperature, seed=11)).sample(logits, k)
    order = torch.randperm(24, generator=torch.Generator().manual_seed(1)).tolist()
    shuffled = sampler.sample(logits[order], [k[i] for i in order])
    assert shuffled == [picks[i] for i in order]
    alone = [sampler.sample(logits[i : i + 1], [k[i]])[0] for i in range(24)]
    assert alone == picks
    # With other rows around it (a different batch composition).
    mixed = sampler.sample(torch.cat([masked_logits(5, seed=9), logits[:3]]), keys(5, 100) + k[:3])
    assert mixed[5:] == picks[:3]


@pytest.mark.parametrize("temperature", [0.0, 0.3, 1.0, 100.0])
@pytest.mark.parametrize("keep", [1e-4, 0.01, 0.5])
def test_never_picks_a_masked_token(temperature, keep):
    logits = masked_logits(32, seed=3, keep=keep)
    logits[:, 5] = 0.0  # at least one allowed token per row
    sampler = Sampler(SamplingConfig(temperature=temperature, seed=2))
    for start in (0, 1000, 5000):
        picks = sampler.sample(logits, keys(32, start))
        assert all(math.isfinite(logits[i, t]) for i, t in enumerate(picks))


def test_masked_edges_of_the_vocabulary():
    # Only the very first or very last token allowed, vocabularies that do
    # and do not fill whole blocks.
    sampler = Sampler(SamplingConfig(temperature=1.0))
    for vocab in (1024, 2048, 263, V):
        for allowed in (0, vocab - 1):
            row = torch.full((1, vocab), NEG)
            row[0, allowed] = -50.0
            assert sampler.sample(row, [("r", 0)]) == [allowed]


def test_follows_the_distribution():
    # Two blocks of the CDF: the last allowed token sits in the second.
    logits = torch.tensor([[0.0, 1.0, 2.0, NEG] + [NEG] * 1030 + [0.5]])
    n = 12_000
    for temperature in (1.0, 2.0):
        sampler = Sampler(SamplingConfig(temperature=temperature, seed=5))
        picks = sampler.sample(logits.expand(n, -1), [("r", i) for i in range(n)])
        counts = collections.Counter(picks)
        probs = torch.softmax(logits[0] / temperature, dim=-1)
        assert set(counts) == {0, 1, 2, 1034}
        for token, count in counts.items():
            expected = n * float(probs[token])
            assert abs(count - expected) < 5 * math.sqrt(expected), (token, count, expected)


def test_picks_depend_on_seed_request_and_position():
    logits = torch.zeros(1, 1000).expand(200, -1)
    base = Sampler(SamplingConfig(temperature=1.0, seed=0))
    picks = base.sample(logits, [("a", i) for i in range(200)])
    assert len(set(picks)) > 100  # positions differ
    assert picks != base.sample(logits, [("b", i) for i in range(200)])
    other = Sampler(SamplingConfig(temperature=1.0, seed=1))
    assert picks != other.sample(logits, [("a", i) for i in range(200)])


def test_uniform_bits_are_stable():
    # A fixed value (no per-process hash): a change here changes every
    # sampled output.
    assert uniform_bits(0, "req", 3) == 2057930842742657 < 2**53
    assert uniform_bits(0, "req", 3) != uniform_bits(0, "req", 4)
    assert uniform_bits(0, "a\0b", 1) != uniform_bits(0, "a", 1)


def test_rejects_bad_input():
    sampler = Sampler(SamplingConfig(temperature=1.0))
    with pytest.raises(ValueError, match="keys"):
        sampler.sample(torch.zeros(2, 8), [("r", 0)])
    dead = torch.zeros(2, 8)
    dead[1] = NEG
    for s in (sampler, Sampler(SamplingConfig())):
        with pytest.raises(ValueError, match=r"\[1\]"):
            s.sample(dead, [("r", 0), ("r", 1)])
    assert sampler.sample(torch.zeros(0, 8), []) == []


def test_bfloat16_logits():
    logits = masked_logits(8).to(torch.bfloat16)
    picks = Sampler(SamplingConfig(temperature=0.8)).sample(logits, keys(8))
    assert all(math.isfinite(float(logits[i, t])) for i, t in enumerate(picks))
