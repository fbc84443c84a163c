"""The mask half of a ``RankSession``: what the last stage's ranks call each step.

``RankSession`` inherits these; they use its attributes (``builder``,
``applier``, ``channel``, ``jump``, the per-request grammar states and the
set of requests masked but not yet advanced). See ``session.py`` for the
step order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from gramcoord.rank_worker.masks.bitmask import trim_drafts
from gramcoord.rank_worker.masks.grammar_state import GrammarState
from gramcoord.rank_worker.masks.jump_forward import JumpResult
from gramcoord.rank_worker.session.types import MaskBatch, StaleGrammarState


class SessionMasks:
    """Bitmask rows, apply, and the grammar-state calls after sampling."""

    rank: int
    tokenizer: Any
    book: Any
    reader: Any
    builder: Any
    applier: Any
    channel: Any
    jump: Any
    _states: dict[str, GrammarState]
    _awaiting: set[str]
    _stats: Any

    def _need(self, what: str, obj: Any) -> Any:
        if obj is None:
            raise RuntimeError(f"[rank {self.rank}] {what} is not available on this rank's role")
        return obj

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

        On a ``read`` TP follower (``parallel.tp_followers: read``) the rows
        are the ones the leader published for ``step`` (required there),
        read in place from shared memory: ``release(step)`` after applying
        them.

        Raises
        ------
        StaleGrammarState
            A request's previous rows were built but its sampled tokens were
            never passed to ``advance``.
        """
        if self.book is not None:
            return self._read_rows(request_ids, drafts, step, copy)
        builder = self._need("bitmask", self.builder)
        stale = [r for r in request_ids if r in self._awaiting]
        if stale:
            raise StaleGrammarState(
                f"[rank {self.rank}] requests {stale[:4]} were masked last step but never "
                "advanced; call advance() with the sampled tokens first"
            )
        states = [self.state(r) for r in request_ids]
        slot = None
        if self.channel is not None and not copy:
            # Fill the next ring slot in place: publish() then announces the
            # rows without copying them (the copy is most of a publish).
            slot = self.channel.acquire(len(request_ids) * builder.rows_per_request)
        built = builder.build(states, drafts, out=slot)
        self._awaiting.update(request_ids)
        self._stats.masks_built += 1
        ids = tuple(request_ids)
        num_drafts = tuple(len(d) for d in drafts) if drafts is not None else (0,) * len(ids)
        failures = {ids[i]: err for i, err in built.failures.items()}
        rows = built.bitmask.copy() if copy else built.bitmask
        return MaskBatch(rows, ids, num_drafts, failures)

    def _read_rows(self, request_ids, drafts, step, copy) -> MaskBatch:
        if step is None:
            raise ValueError(f"[rank {self.rank}] a read follower needs the step to read")
        got = self._need("bitmask", self.reader).receive(step)
        ids = tuple(request_ids)
        num_drafts = tuple(len(d) for d in drafts) if drafts is not None else (0,) * len(ids)
        if got.request_ids != ids or got.num_drafts != num_drafts:
            self.reader.release(step)
            raise StaleGrammarState(
                f"[rank {self.rank}] step {step}: the leader published rows for "
                f"{list(got.request_ids)[:4]} (drafts {list(got.num_drafts)[:4]}), this "
                f"scheduler asked for {list(ids)[:4]} (drafts {list(num_drafts)[:4]}): "
                "the schedulers diverged"
            )
        self._stats.masks_built += 1
        return MaskBatch(got.rows.copy() if copy else got.rows, ids, num_drafts, {})

    def release(self, step: int) -> None:
        """Give step ``step``'s rows back to the leader (``read`` followers only)."""
        if self.book is not None:
            self._need("release", self.reader).release(step)

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
        if self.channel is not None:
            self.channel.publish(step, batch.rows, batch.request_ids, batch.num_drafts)

    def apply(
        self,
        logits: torch.Tensor,
        rows: np.ndarray,
        *,
        batch: Sequence[str],
        constrained: Sequence[str],
        num_drafts: Mapping[str, int],
    ) -> tuple[int, dict[str, tuple[int, ...]]]:
        """Mask ``logits`` in place with ``rows``; see ``MaskApplier.apply``."""
        applier = self._need("apply", self.applier)
        out = applier.apply(
            logits, rows, batch=batch, constrained=constrained, num_drafts=num_drafts
        )
        self._stats.rows_applied += sum(1 + num_drafts.get(r, 0) for r in constrained)
        return out

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
        if self.book is not None:  # no grammar here: it ends with its stop token
            return any(t in self.tokenizer.stop_ids for t in tokens)
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
        if self.jump is None:
            return None
        return self.jump.jump(self.state(request_id), output)
