"""The gate in front of a grammar: reasoning first, then a trigger, then JSON.

A constrained request may begin with text the grammar must not see:

1. **Reasoning.** Unconstrained until a think-end token. An *explicit*
   end token (``</think>``) is not content; the grammar starts with the
   token after it. An *implicit* end token (for example a tool-call tag a
   model emits without closing its thoughts) ends reasoning and is itself
   the first content token, so the grammar judges it.
2. **Trigger.** Unconstrained until one of the trigger token sequences has
   appeared (KMP, see ``gramcoord.rank_worker.masks.trigger``). The trigger tokens are not
   content; the grammar starts with the token after them.
3. **Constrained.** Every token is fed to the grammar.

Either stage may be absent. The gate is a value: phases and trigger
progress are held by ``GrammarState``, which keeps the old values so that a
rollback across a boundary restores the earlier phase exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import IntEnum
from typing import NamedTuple

from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.masks.trigger import Progress, TriggerMatcher


class Phase(IntEnum):
    REASONING = 0
    AWAIT_TRIGGER = 1
    CONSTRAINED = 2


class ConstraintBounds(NamedTuple):
    """Where a run of drafts crosses from the gate into the grammar.

    ``grammar_start``: index of the first draft fed to the grammar.
    ``constraint_start``: index of the first mask row the grammar fills;
    rows before it are unconstrained (apart from masked implicit end
    tokens). They differ by one exactly when an implicit end token is both
    the last reasoning token and the first content token. Both equal
    ``len(drafts) + 1`` when no row is constrained.
    """

    grammar_start: int
    constraint_start: int


CONSTRAINED_FROM_START = ConstraintBounds(0, 0)


class Gate:
    """Where the constraint starts, for one request.

    Parameters
    ----------
    think_end_ids:
        Explicit reasoning-end token ids; not fed to the grammar.
    implicit_end_ids:
        Token ids that end reasoning and are the first content token.
    start_in_reasoning:
        Whether a request starts in the reasoning phase. Ignored when there
        are no end ids.
    triggers:
        Token sequences after which the constraint starts (after reasoning,
        if both are configured).

    Raises
    ------
    ValueError
        An id is both an explicit and an implicit end, or a trigger sequence
        is empty.
    """

    __slots__ = ("_after_reasoning", "implicit_end_ids", "initial", "think_end_ids", "triggers")

    def __init__(
        self,
        *,
        think_end_ids: Iterable[int] = (),
        implicit_end_ids: Iterable[int] = (),
        start_in_reasoning: bool = True,
        triggers: Sequence[Sequence[int]] = (),
    ) -> None:
        self.think_end_ids = frozenset(int(t) for t in think_end_ids)
        self.implicit_end_ids = frozenset(int(t) for t in implicit_end_ids)
        both = self.think_end_ids & self.implicit_end_ids
        if both:
            raise ValueError(f"token ids {sorted(both)} are both explicit and implicit ends")
        self.triggers = TriggerMatcher(triggers) if triggers else None
        self._after_reasoning = Phase.AWAIT_TRIGGER if self.triggers else Phase.CONSTRAINED
        reasoning = bool(self.think_end_ids or self.implicit_end_ids) and start_in_reasoning
        phase = Phase.REASONING if reasoning else self._after_reasoning
        self.initial: tuple[Phase, Progress] = (phase, self._initial_progress)

    @classmethod
    def from_config(cls, config: GrammarConfig) -> Gate:
        r = config.reasoning
        return cls(
            think_end_ids=r.think_end_ids,
            implicit_end_ids=r.implicit_end_ids,
            start_in_reasoning=r.start_in_reasoning,
            triggers=config.triggers.sequences,
        )

    @property
    def _initial_progress(self) -> Progress:
        return self.triggers.initial if self.triggers else ()

    @property
    def is_open(self) -> bool:
        """True when requests start constrained (no gate at all)."""
        return self.initial[0] == Phase.CONSTRAINED

    @property
    def masks_implicit_ends(self) -> bool:
        """Whether reasoning rows must mask implicit ends the grammar rejects.

        Only when the grammar, not a trigger, follows the reasoning.
        """
        return bool(self.implicit_end_ids) and self._after_reasoning == Phase.CONSTRAINED

    def step(self, phase: Phase, progress: Progress, token: int) -> tuple[Phase, Progress, bool]:
        """One token through the gate.

        Returns
        -------
        (phase, progress, feed):
            The phase and trigger progress after ``token``, and whether
            ``token`` itself goes to the grammar.
        """
        if phase == Phase.CONSTRAINED:
            return phase, progress, True
        if phase == Phase.REASONING:
            if token in self.think_end_ids:
                return self._after_reasoning, self._initial_progress, False
            if token not in self.implicit_end_ids:
                return phase, progress, False
            if self._after_reasoning == Phase.CONSTRAINED:
                return Phase.CONSTRAINED, (), True
            # An implicit end opens the trigger stage and may start a trigger.
            phase, progress = Phase.AWAIT_TRIGGER, self._initial_progress
        assert self.triggers is not None
        progress, hit = self.triggers.advance(progress, token)
        if hit:
            return Phase.CONSTRAINED, (), False
        return phase, progress, False

    def bounds(self, phase: Phase, progress: Progress, drafts: Sequence[int]) -> ConstraintBounds:
        """``(grammar_start, constraint_start)`` for ``drafts`` from this state."""
        if phase == Phase.CONSTRAINED:
            return CONSTRAINED_FROM_START
        for i, token in enumerate(drafts):
            phase, progress, feed = self.step(phase, progress, token)
            if phase == Phase.CONSTRAINED:
                return ConstraintBounds(i if feed else i + 1, i + 1)
        n = len(drafts) + 1
        return ConstraintBounds(n, n)

    def __repr__(self) -> str:
        return (
            f"Gate(think_end_ids={sorted(self.think_end_ids)}, "
            f"implicit_end_ids={sorted(self.implicit_end_ids)}, initial={self.initial[0].name}, "
            f"triggers={self.triggers!r})"
        )


OPEN_GATE = Gate()
