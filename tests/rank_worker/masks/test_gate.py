"""KMP trigger matching and the reasoning/trigger gate's constraint bounds."""

from __future__ import annotations

import pytest

from gramcoord.rank_worker.config import GrammarConfig, ReasoningConfig, TriggerConfig
from gramcoord.rank_worker.masks.gate import ConstraintBounds, Gate, Phase
from gramcoord.rank_worker.masks.trigger import TriggerMatcher

END, IMPLICIT, T1, T2, X = 900, 901, 7, 8, 1


def first_match(matcher: TriggerMatcher, tokens: list[int]) -> int | None:
    progress = matcher.initial
    for i, t in enumerate(tokens):
        progress, hit = matcher.advance(progress, t)
        if hit:
            return i
    return None


@pytest.mark.parametrize(
    ("sequences", "tokens", "expected"),
    [
        pytest.param([(7, 8)], [1, 7, 8, 2], 2, id="simple"),
        pytest.param([(7, 8)], [7, 7, 8], 2, id="restart-on-repeat"),
        pytest.param([(1, 1, 2)], [1, 1, 1, 2], 3, id="border-fallback"),
        pytest.param([(1, 2, 1, 3)], [1, 2, 1, 2, 1, 3], 5, id="overlapping-prefix"),
        pytest.param([(5, 6, 7), (6, 9)], [5, 6, 9], 2, id="second-sequence-first"),
        pytest.param([(5,)], [4, 5], 1, id="single-token"),
        pytest.param([(7, 8)], [7, 1, 8], None, id="interrupted"),
    ],
)
def test_trigger_matcher_finds_first_completion(sequences, tokens, expected):
    assert first_match(TriggerMatcher(sequences), tokens) == expected


@pytest.mark.parametrize(
    "sequences", [pytest.param([], id="none"), pytest.param([(1,), ()], id="empty-sequence")]
)
def test_trigger_matcher_rejects_bad_sequences(sequences):
    with pytest.raises(ValueError, match="trigger"):
        TriggerMatcher(sequences)


@pytest.mark.parametrize(
    ("gate", "drafts", "bounds"),
    [
        pytest.param(Gate(), [X, X], ConstraintBounds(0, 0), id="no-gate"),
        pytest.param(Gate(think_end_ids=[END]), [X, X], ConstraintBounds(3, 3), id="reasoning"),
        pytest.param(Gate(think_end_ids=[END]), [], ConstraintBounds(1, 1), id="no-drafts"),
        pytest.param(Gate(think_end_ids=[END]), [END, X], ConstraintBounds(1, 1), id="end-first"),
        pytest.param(Gate(think_end_ids=[END]), [X, END], ConstraintBounds(2, 2), id="end-last"),
        pytest.param(
            Gate(think_end_ids=[END], implicit_end_ids=[IMPLICIT]),
            [X, IMPLICIT, X],
            ConstraintBounds(1, 2),
            id="implicit-end-is-content",
        ),
        pytest.param(
            Gate(think_end_ids=[END], start_in_reasoning=False), [X], (0, 0), id="start-after"
        ),
        pytest.param(Gate(triggers=[(T1, T2)]), [X, T1, T2, X], (3, 3), id="trigger"),
        pytest.param(Gate(triggers=[(T1, T2)]), [T1, X, T2], (4, 4), id="trigger-broken"),
        pytest.param(
            Gate(think_end_ids=[END], triggers=[(T1, T2)]),
            [T1, T2, END, T1, T2],
            (5, 5),
            id="trigger-counts-only-after-reasoning",
        ),
        pytest.param(
            Gate(implicit_end_ids=[T1], triggers=[(T1, T2)]),
            [T1, T2],
            (2, 2),
            id="implicit-end-starts-trigger",
        ),
    ],
)
def test_bounds(gate, drafts, bounds):
    phase, progress = gate.initial
    assert gate.bounds(phase, progress, drafts) == bounds


def test_gate_from_config():
    config = GrammarConfig(
        reasoning=ReasoningConfig(think_end_ids=(END,), implicit_end_ids=(IMPLICIT,)),
        triggers=TriggerConfig(sequences=((T1, T2),)),
    )
    gate = Gate.from_config(config)
    assert gate.initial[0] == Phase.REASONING
    assert gate.think_end_ids == {END} and gate.implicit_end_ids == {IMPLICIT}
    assert gate.triggers is not None and gate.triggers.sequences == ((T1, T2),)
    assert not gate.masks_implicit_ends  # a trigger, not the grammar, follows reasoning
    assert Gate.from_config(GrammarConfig()).is_open


def test_overlapping_end_ids_are_rejected():
    with pytest.raises(ValueError, match="both"):
        ReasoningConfig(think_end_ids=(END,), implicit_end_ids=(END,))
    with pytest.raises(ValueError, match="both"):
        Gate(think_end_ids=[END], implicit_end_ids=[END])
