"""The last stage's mask role: build rows, publish them, advance the grammars.

The last pipeline stage's leader holds one ``StageMasks`` (``session.masks``),
and so does a ``fill`` TP follower there. It keeps one ``GrammarState`` per
running request (started when a ``step`` admits it, dropped when the
request ends) and the set of requests masked but not yet advanced. Calls,
in step order: ``bitmask`` then ``publish`` while the logits are computed;
``apply`` (with ``commit``); ``advance``, ``validate_drafts``, ``rollback``
and ``jump_forward`` after sampling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import xgrammar as xgr

from gramcoord.rank_worker.grammars.outcome import Outcome
from gramcoord.rank_worker.masks.bitmask import BitmaskBuilder, trim_drafts
from gramcoord.rank_worker.masks.gate import Gate
from gramcoord.rank_worker.masks.grammar_state import GrammarState
from gramcoord.rank_worker.masks.jump_forward import JumpForward, JumpResult
from gramcoord.rank_worker.session.applier import AppliesRows, MaskApplier
from gramcoord.rank_worker.session.types import MaskBatch, SessionStats, StaleGrammarState
from gramcoord.sync.channel import BitmaskChannel


class StageMasks(AppliesRows):
    """Bitmask rows, apply, and the grammar-state calls after sampling.

    Parameters
    ----------
    builder:
        Fills the rows.
    applier:
        Aligns, applies and digests rows (``AppliesRows``).
    matcher:
        ``request_id -> GrammarMatcher`` of an admitted request (the
        manager's).
    channel:
        The bitmask channel to this stage's TP workers, or ``None``.
    jump:
        Jump-forward, or ``None`` when it is off.
    """

    def __init__(
        self,
        builder: BitmaskBuilder,
        applier: MaskApplier,
        matcher: Callable[[str], xgr.GrammarMatcher],
        *,
        vocab_size: int,
        gate: Gate,
        stats: SessionStats,
        channel: BitmaskChannel | None = None,
        jump: JumpForward | None = None,
        rank: int = 0,
    ) -> None:
        self.builder = builder
        self._applier = applier
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._gate = gate
        self._stats = stats
        self._channel = channel
        self._jump = jump
        self.rank = rank
        self._states: dict[str, GrammarState] = {}
        self._awaiting: set[str] = set()

    # -- request lifecycle (called by the stage leader's role) -------------------

    def start(self, admitted: list[Outcome]) -> None:
        """Start the grammar state of each request a step admitted."""
        for o in admitted:
            self._states[o.request_id] = GrammarState.from_matcher(
                self._matcher(o.request_id), vocab_size=self._vocab_size, gate=self._gate
            )

    def forget(self, request_id: str) -> None:
        """Drop a finished or aborted request's state (unknown ids are ignored)."""
        self._states.pop(request_id, None)
        self._awaiting.discard(request_id)

    def is_running(self, request_id: str) -> bool:
        """Whether ``request_id`` was admitted here and has a grammar state.

        Parameters
        ----------
        request_id:
            The request.
        """
        return request_id in self._states

    def state(self, request_id: str) -> GrammarState:
        """The grammar state of a running request (last-stage leader).

        Raises
        ------
        KeyError
            The request is not running on this rank.
        """
        try:
            return self._states[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not running on rank {self.rank}") from None

    def validate_drafts(self, request_id: str, drafts: Sequence[int]) -> list[int]:
        """The longest grammar-valid prefix of ``drafts`` (state unchanged).

        Parameters
        ----------
        request_id:
            A running request.
        drafts:
            Proposed draft tokens (``-1`` pads).

        Returns
        -------
        list of int
            The kept prefix; the first invalid position becomes the next
            build's bonus row.
        """
        return trim_drafts(self.state(request_id), drafts)

    def bitmask(
        self,
        request_ids: Sequence[str],
        drafts: Sequence[Sequence[int]] | None = None,
        *,
        copy: bool = False,
        step: int | None = None,
    ) -> MaskBatch:
        """Fill the rows of ``request_ids`` (drafts included).

        The rows are a view of the builder's buffer (with TP workers: of the
        transport's next ring slot, which ``publish`` then sends without a
        copy), valid until the next call. A scheduler that pipelines steps
        (builds step n+1 before step n's rows are applied) passes
        ``copy=True`` to own its rows.

        ``step`` is accepted for the same call as a ``read`` follower's
        (``FollowerRows.bitmask``), and unused here.

        Raises
        ------
        StaleGrammarState
            A request's previous rows were built but its sampled tokens were
            never passed to ``advance``.
        """
        builder = self.builder
        stale = [r for r in request_ids if r in self._awaiting]
        if stale:
            raise StaleGrammarState(
                f"[rank {self.rank}] requests {stale[:4]} were masked last step but never "
                "advanced; call advance() with the sampled tokens first"
            )
        states = [self.state(r) for r in request_ids]
        slot = None
        if self._channel is not None and not copy:
            # Fill the next ring slot in place: publish() then announces the
            # rows without copying them (the copy is most of a publish).
            slot = self._channel.acquire(len(request_ids) * builder.rows_per_request)
        built = builder.build(states, drafts, out=slot)
        self._awaiting.update(request_ids)
        self._stats.masks_built += 1
        ids = tuple(request_ids)
        num_drafts = tuple(len(d) for d in drafts) if drafts is not None else (0,) * len(ids)
        failures = {ids[i]: err for i, err in built.failures.items()}
        rows = built.bitmask.copy() if copy else built.bitmask
        return MaskBatch(rows, ids, num_drafts, failures)

    def release(self, step: int) -> None:
        """A no-op: the rows are this rank's own (``read`` followers give theirs back)."""

    def publish(self, step: int, batch: MaskBatch) -> None:
        """Send ``batch`` to this stage's TP workers (no-op without workers).

        Parameters
        ----------
        step:
            The step the rows belong to (workers receive by step).
        batch:
            What ``bitmask`` returned.

        Raises
        ------
        TransportTimeout, PeerGone
            A worker did not release a slot in time, or died.
        """
        if self._channel is not None:
            self._channel.publish(step, batch.rows, batch.request_ids, batch.num_drafts)

    def advance(self, request_id: str, tokens: Sequence[int]) -> bool:
        """Accept sampled ``tokens`` into the request's grammar.

        Parameters
        ----------
        request_id:
            A running request whose rows were built this step.
        tokens:
            The tokens sampled for it (accepted drafts and the bonus token).

        Returns
        -------
        bool
            Whether the grammar terminated (accepted its stop token).

        Raises
        ------
        GrammarError
            A token the grammar rejects (the request must fail).
        """
        state = self.state(request_id)
        self._awaiting.discard(request_id)
        state.accept_tokens(tokens)
        return state.is_terminated

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens of a running request."""
        self.state(request_id).rollback(num_tokens)

    def jump_forward(self, request_id: str, output: list[int]) -> JumpResult | None:
        """Append grammar-forced tokens to ``output`` (in place), if enabled.

        Parameters
        ----------
        request_id:
            A running request.
        output:
            Its output token ids; changed in place.

        Returns
        -------
        JumpResult or None
            What was appended (and rolled back), or ``None``.
        """
        if self._jump is None:
            return None
        return self._jump.jump(self.state(request_id), output)
