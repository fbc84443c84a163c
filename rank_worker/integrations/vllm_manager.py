"""vLLM's ``StructuredOutputManager`` role over a ``RankSession`` (see ``vllm_backend``).

``GramcoordStructuredOutputManager`` is what a vLLM-shaped scheduler talks
to: ``grammar_init`` on arrival, ``update(step)`` at the top of every
``schedule()`` on every rank (the session's one collective), and
``grammar_bitmask`` while the forward runs. The module docstring of
``gramcoord.rank_worker.integrations.vllm_backend`` maps every call to its
vLLM call site.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from gramcoord.rank_worker.errors import ErrorCode
from gramcoord.rank_worker.grammars.manager import Outcome
from gramcoord.rank_worker.integrations.vllm_backend import (
    GramcoordBackend,
    GramcoordGrammar,
    GrammarInitError,
)
from gramcoord.rank_worker.session.session import RankSession
from gramcoord.rank_worker.session.types import StepOutcome

__all__ = ["GramcoordStructuredOutputManager"]


class GramcoordStructuredOutputManager:
    """vLLM's ``StructuredOutputManager`` role for one rank; see the module docstring.

    Parameters
    ----------
    session:
        This rank's session; a stage leader (the scheduler's rank).
    backend:
        Defaults to a ``GramcoordBackend`` that owns the session.
    """

    def __init__(self, session: RankSession, *, backend: GramcoordBackend | None = None) -> None:
        self.session = session
        self.backend = backend or GramcoordBackend(session)
        self.num_speculative_tokens = session.k
        self._grammars: dict[str, GramcoordGrammar] = {}
        self._futures: dict[str, Future] = {}
        self._last_step = 0

    # -- arrival --------------------------------------------------------------

    def grammar_init(self, request: Any, *, seq: int | None = None) -> Outcome | None:
        """Start a request's compile; its grammar slot becomes a pending ``Future``.

        Parameters
        ----------
        request:
            Anything with ``request_id`` and ``structured_output_request``
            (``None`` for an unconstrained request, which is left alone).
        seq:
            Stage 0's sequence number (later pipeline stages only).

        Returns
        -------
        Outcome or None
            ``submit``'s answer (stage 0 forwards ``outcome.seq`` down the
            chain); ``None`` for an unconstrained request. A request that
            fails at once (bad spec, poisoned key) gets its
            ``GrammarInitError`` on the spot, identically on every rank.
        """
        sor = request.structured_output_request
        if sor is None:
            return None
        request_type, grammar_spec = sor.structured_output_key
        rid = request.request_id
        grammar = self.backend.compile_grammar(request_type, grammar_spec, request_id=rid, seq=seq)
        future: Future = Future()
        sor.grammar = future
        outcome = grammar.outcome
        if outcome.status == "failed":
            future.set_exception(_init_error(outcome))
        else:
            self._grammars[rid] = grammar
            self._futures[rid] = future
        return outcome

    # -- the per-step collective ----------------------------------------------

    def update(self, step: int | None = None) -> StepOutcome:
        """Agree on readiness (``session.step``) and resolve the grammar slots.

        Call it at the top of every ``schedule()``, on every rank with a
        scheduler, whatever is scheduled (module docstring).

        Parameters
        ----------
        step:
            Increasing step number; ``None`` takes the previous one plus 1.
            Later pipeline stages pass stage 0's.

        Returns
        -------
        StepOutcome
            The requests admitted and failed by this step's decision
            (``stage_failed``: admitted upstream but not compiled here).

        Raises
        ------
        PeerLostError, DivergenceError
            Infrastructure failures from the collective.
        """
        step = self._last_step + 1 if step is None else step
        self._last_step = step
        decided = self.session.step(step)
        for o in decided.admitted:
            future = self._futures.pop(o.request_id, None)
            if future is not None and not future.done():
                future.set_result(self._grammars[o.request_id])
        for o in decided.failed:
            self._grammars.pop(o.request_id, None)
            future = self._futures.pop(o.request_id, None)
            if future is not None and not future.done():
                future.set_exception(_init_error(o))
        return decided

    # -- masks (last-stage leader) --------------------------------------------

    def grammar_bitmask(
        self,
        requests: Mapping[str, Any],
        structured_output_request_ids: Sequence[str],
        scheduled_spec_decode_tokens: Mapping[str, Sequence[int]],
    ) -> np.ndarray | None:
        """The bitmask rows of the scheduled structured requests, drafts included.

        Parameters
        ----------
        requests:
            The scheduler's requests by id (vLLM's signature; grammars are
            looked up by id here).
        structured_output_request_ids:
            The scheduled structured requests, in row order.
        scheduled_spec_decode_tokens:
            Draft tokens per request id (``-1`` pads).

        Returns
        -------
        numpy.ndarray or None
            int32 ``[sum(1 + drafts), ceil(V / 32)]`` in vLLM's compact
            layout (module docstring), or ``None`` with no structured
            request. With no drafts the rows are a view valid until the
            next call; with drafts, a copy.

        Raises
        ------
        StaleGrammarState
            A request masked before whose sampled tokens never reached
            ``accept_tokens`` (vllm#45015). A host that masks a request and
            then keeps no token of it for that step (a discarded output)
            says so with ``accept_tokens(request_id, [])``.
        """
        del requests  # grammars are kept by request id
        ids = list(structured_output_request_ids)
        if not ids:
            return None
        drafts = [list(scheduled_spec_decode_tokens.get(r, ())) for r in ids]
        k = self.num_speculative_tokens
        batch = self.session.bitmask(ids, drafts if k else None)
        for rid, err in batch.failures.items():
            grammar = self._grammars.get(rid)
            if grammar is not None:
                grammar.error = err
        if all(len(d) == k for d in drafts):
            return batch.rows
        rows = [j * (1 + k) + i for j, d in enumerate(drafts) for i in range(1 + len(d))]
        return batch.rows[rows]

    # -- after sampling ---------------------------------------------------------

    def grammar(self, request_id: str) -> GramcoordGrammar | None:
        """The grammar of a live structured request (pending or running), if any."""
        return self._grammars.get(request_id)

    def should_advance(self, request: Any) -> bool:
        """Whether ``update_from_output`` must feed the request's tokens to its grammar.

        The reasoning gate lives inside the grammar state, so every running
        structured request advances.
        """
        return self.session.is_running(request.request_id)

    # -- lifecycle --------------------------------------------------------------

    def finish_request(self, request_id: str) -> None:
        """Forget a finished request (every stage leader, the same step)."""
        self._drop(request_id)
        self.session.finish(request_id)

    def abort_request(self, request_id: str) -> bool:
        """Drop a request wherever it is (waiting, compiling or running)."""
        self._drop(request_id)
        return self.session.abort(request_id)

    def _drop(self, request_id: str) -> None:
        self._grammars.pop(request_id, None)
        future = self._futures.pop(request_id, None)
        if future is not None and not future.done():
            future.set_exception(
                GrammarInitError(request_id, ErrorCode.aborted.name, "request finished or aborted")
            )

    def clear_backend(self) -> None:
        """Engine shutdown: ``backend.destroy()``."""
        self.backend.destroy()


def _init_error(outcome: Outcome) -> GrammarInitError:
    code = outcome.code or ErrorCode.grammar_internal.name
    return GrammarInitError(outcome.request_id, code, outcome.message)
