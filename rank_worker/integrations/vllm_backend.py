"""vLLM-shaped structured output over a ``RankSession``: backend, grammar, manager.

vLLM's V1 engine splits structured output in three objects: a
``StructuredOutputBackend`` that compiles, a per-request
``StructuredOutputGrammar`` that masks and advances, and the engine-level
``StructuredOutputManager`` the scheduler talks to. This module gives each
of them a gramcoord counterpart with vLLM's method names, so a vLLM-shaped
engine (one scheduler per rank, as under vLLM's external launcher) drives
gramcoord's per-rank session (DESIGN section 14) without a second API.

Interfaces followed: vLLM V1 as its main branch stood in 2026
(``vllm/v1/structured_output/{__init__,backend_types,request,utils}.py``,
``vllm/v1/core/sched/scheduler.py``, ``vllm/v1/engine/core.py``), the shape
it has had since v0.11.1: ``EngineCore.step`` calls
``execute_model(..., non_block=True)``, then ``Scheduler.get_grammar_bitmask``
while the forward runs, then ``sample_tokens(grammar_output)``; and a
request's ``StructuredOutputRequest`` holds its grammar as a ``Future`` that
resolves to the grammar or to an ``Exception``. Nothing here imports vLLM.

Where each method is called
---------------------------

vLLM call site -> here -> what it runs on the session:

- ``EngineCore.__init__`` builds the ``StructuredOutputManager`` ->
  ``GramcoordStructuredOutputManager(session)`` -> a session from
  ``RankSession.start`` / ``attach`` / ``local``.
- ``Scheduler.add_request`` -> ``StructuredOutputManager.grammar_init`` ->
  ``manager.grammar_init(request)`` -> ``backend.compile_grammar`` ->
  ``session.submit`` (async compile; never raises).
- **Top of** ``Scheduler.schedule()``, every call, every rank ->
  ``manager.update(step)`` -> ``session.step(n)``, the one collective.
- ``schedule()`` promoting requests that wait for their grammar
  (``structured_output_request.is_grammar_ready`` / ``.grammar``) -> the
  grammar slot, a ``Future`` that only ``update`` resolves.
- ``Scheduler.get_grammar_bitmask`` ->
  ``StructuredOutputManager.grammar_bitmask(requests, ids,
  scheduled_spec_decode_tokens)`` -> ``manager.grammar_bitmask`` ->
  ``session.bitmask`` (drafts included), returned as numpy.
- ``GPUModelRunner.sample_tokens`` -> ``apply_grammar_bitmask`` -> the
  worker's own code: ``plan_rows`` + ``LogitsMasker`` (see "Bitmask
  layout").
- ``Scheduler.update_from_output`` -> ``grammar.accept_tokens(id, tokens)``
  -> ``session.advance``.
- ``Scheduler.update_draft_token_ids`` -> ``grammar.validate_tokens(drafts)``
  -> ``session.validate_drafts``.
- ``grammar.rollback(n)`` -> ``session.rollback``; ``grammar.fill_bitmask``
  (vLLM's per-row ``_fill_bitmasks``), ``is_terminated``, ``reset``,
  ``find_jump_string`` -> the request's ``GrammarState``.
- ``Scheduler._free_request`` / ``finish_requests`` ->
  ``manager.finish_request`` / ``abort_request`` -> ``session.finish`` /
  ``abort``.
- ``EngineCore.shutdown`` -> ``clear_backend`` -> ``backend.destroy()`` ->
  ``session.close``.

Where ``step`` must go
----------------------

``manager.update(step)`` runs ``session.step``, the collective that agrees
on which compiles are ready (ready = intersection, failed = union over the
ranks that share a request stream, DESIGN section 3). Call it **first thing
in every** ``Scheduler.schedule()`` **call, on every rank that runs a
scheduler, whether or not structured requests are waiting or scheduled**:

- not in ``get_grammar_bitmask``: vLLM skips that when no structured
  request is scheduled, so one rank would enter the collective and its peer
  would not (the uneven-collective hang of SGLang #3600);
- not in a compile callback or on a timer: readiness must change at the
  same scheduling point on every rank.

A request's grammar slot (``request.structured_output_request.grammar``)
is a ``Future`` that only ``update`` resolves: to the grammar when the
decision admits the request, to a ``GrammarInitError`` when it fails it
(bad spec, compile error, compile timeout, stage timeout). Every rank
therefore promotes and fails the same requests in the same ``schedule()``
call, which is what lets async compile run under an external launcher
(vLLM forces sync there, vllm#29996) and lets a compile failure finish its
request instead of hanging it or crashing the engine (vllm#45012).

With pipeline parallelism, stage 0's scheduler calls ``grammar_init`` and
``update``; every later stage's leader calls ``grammar_init(request,
seq=...)`` with stage 0's sequence numbers, in the same order, *before* its
``update(step)`` with stage 0's step number; the last stage's leader then
builds the masks (``grammar_bitmask``) and accepts the tokens.

Bitmask layout
--------------

``grammar_bitmask`` returns vLLM's compact layout, numpy ``int32``: for
each structured request, in the order given, ``1 + len(spec tokens)`` rows
(row ``i`` is the mask after drafts ``0..i-1``; ``-1`` drafts are padding
and get full rows). gramcoord's own layout (DESIGN section 4) keeps a fixed
``1 + K`` rows per request; the two are equal when every request has ``K``
drafts. A worker maps the rows to logits with ``plan_rows`` (logit row =
batch index + drafts of earlier requests) and ``src = arange(rows)``.

A request whose rows were built but whose sampled tokens never reached
``accept_tokens`` is stale: the next ``grammar_bitmask`` naming it raises
``StaleGrammarState`` instead of masking with a state one step behind the
model (vllm#45015).
"""

from __future__ import annotations

import enum
import itertools
import json
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch
import xgrammar as xgr

from gramcoord.rank_worker.errors import GrammarError
from gramcoord.rank_worker.grammars.manager import Outcome
from gramcoord.rank_worker.masks.grammar_state import GrammarState
from gramcoord.rank_worker.session.session import RankSession
from gramcoord.rank_worker.session.types import StaleGrammarState

__all__ = [
    "GramcoordBackend",
    "GramcoordGrammar",
    "GrammarInitError",
    "GrammarNotReady",
    "StaleGrammarState",
    "StructuredOutputOptions",
    "StructuredOutputRequest",
    "spec_from_key",
    "structured_output_key",
]


class StructuredOutputOptions(enum.Enum):
    """The request types of vLLM's ``StructuredOutputOptions`` (same member names).

    ``compile_grammar`` accepts these, vLLM's own enum (matched by member
    name), or the names as strings.
    """

    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    GRAMMAR = "grammar"
    CHOICE = "choice"
    STRUCTURAL_TAG = "structural_tag"


class GrammarInitError(RuntimeError):
    """Why a request's grammar will never be ready; set on its grammar ``Future``.

    Attributes
    ----------
    request_id:
        The request.
    code:
        Stable gramcoord error code (``grammar_invalid``,
        ``grammar_timeout``, ``spec_empty_choice``, ...).
    message:
        What went wrong; identical on every rank.
    """

    def __init__(self, request_id: str, code: str, message: str) -> None:
        super().__init__(f"[{request_id}] {code}: {message}")
        self.request_id = request_id
        self.code = code
        self.message = message


class GrammarNotReady(RuntimeError):
    """A grammar method was called before the agreement admitted its request."""


def _kind_name(request_type: Any) -> str:
    if isinstance(request_type, StructuredOutputOptions):
        return request_type.value
    name = getattr(request_type, "name", request_type)
    return str(name).lower()


def structured_output_key(params: Mapping[str, Any]) -> tuple[StructuredOutputOptions, str]:
    """The ``(request_type, grammar_spec)`` key of a ``structured_outputs`` mapping.

    The same key vLLM derives from ``StructuredOutputsParams``: JSON Schemas
    and choice lists as JSON text, ``json_object`` as ``""``, the other
    kinds as their text. The first kind present wins, in vLLM's order.

    Raises
    ------
    ValueError
        No kind is set (vLLM rejects such a request before it is queued).
    """
    if params.get("json") is not None:
        value = params["json"]
        return StructuredOutputOptions.JSON, value if isinstance(value, str) else json.dumps(value)
    if params.get("json_object"):
        return StructuredOutputOptions.JSON_OBJECT, ""
    if params.get("regex") is not None:
        return StructuredOutputOptions.REGEX, params["regex"]
    if params.get("choice") is not None:
        value = params["choice"]
        text = value if isinstance(value, str) else json.dumps(value)
        return StructuredOutputOptions.CHOICE, text
    if params.get("grammar") is not None:
        return StructuredOutputOptions.GRAMMAR, params["grammar"]
    if params.get("structural_tag") is not None:
        value = params["structural_tag"]
        text = value if isinstance(value, str) else json.dumps(value)
        return StructuredOutputOptions.STRUCTURAL_TAG, text
    raise ValueError(
        "structured_outputs sets none of json, json_object, regex, choice, grammar, structural_tag"
    )


def spec_from_key(request_type: Any, grammar_spec: str) -> dict[str, Any]:
    """The gramcoord spec (vLLM field names) that a vLLM key describes.

    Never raises: an unknown request type or an unparsable choice list
    gives a spec that ``RankSession.submit`` fails with a code.
    """
    kind = _kind_name(request_type)
    if kind == "json_object":
        return {"json_object": True}
    if kind == "choice" and isinstance(grammar_spec, str):
        try:
            return {"choice": json.loads(grammar_spec)}
        except ValueError:
            return {"choice": grammar_spec}  # fails validation: spec_bad_type
    if kind in ("json", "regex", "grammar", "structural_tag"):
        return {kind: grammar_spec}
    return {}  # fails validation: spec_no_kind


class StructuredOutputRequest:
    """The request-side grammar slot, with vLLM's attribute names.

    For hosts without vLLM (gramcoord's examples and tests); a vLLM
    ``Request`` carries its own ``StructuredOutputRequest`` with the same
    ``structured_output_key`` / ``grammar`` / ``is_grammar_ready`` names,
    which is all the manager touches.

    Parameters
    ----------
    structured_output_key:
        ``(request_type, grammar_spec)``, see ``structured_output_key``.
    """

    def __init__(self, structured_output_key: tuple[Any, str]) -> None:
        self.structured_output_key = structured_output_key
        self._grammar: Future | GramcoordGrammar | Exception | None = None

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> StructuredOutputRequest | None:
        """``None`` for an unconstrained request (no ``structured_outputs``)."""
        return None if params is None else cls(structured_output_key(params))

    def _resolve(self) -> bool:
        if isinstance(self._grammar, Future):
            if not self._grammar.done():
                return False
            exc = self._grammar.exception()
            self._grammar = exc if exc is not None else self._grammar.result()
        return True

    @property
    def is_grammar_ready(self) -> bool:
        """Whether the grammar slot is decided (a grammar, or the error that failed it)."""
        return self._resolve()

    @property
    def grammar(self) -> GramcoordGrammar | Exception | None:
        """The grammar once admitted, the ``GrammarInitError`` once failed, else ``None``."""
        return self._grammar if self._resolve() else None  # type: ignore[return-value]

    @grammar.setter
    def grammar(self, value: Future | GramcoordGrammar | Exception | None) -> None:
        """Set the slot: a ``Future``, the grammar, or the ``Exception`` it failed with."""
        self._grammar = value


class GramcoordGrammar:
    """One request's grammar (vLLM's ``StructuredOutputGrammar``), over the session.

    Created by ``GramcoordBackend.compile_grammar`` while the compile is
    still pending; its methods work once a ``step`` decision admitted the
    request (before that they raise ``GrammarNotReady``).

    Parameters
    ----------
    session:
        The rank's session.
    request_id:
        The request the grammar belongs to.
    outcome:
        What ``submit`` answered (``pending``, ``waiting`` or ``failed``).
    """

    def __init__(self, session: RankSession, request_id: str, outcome: Outcome) -> None:
        self.session = session
        self.request_id = request_id
        self.outcome = outcome
        # Why the request cannot go on (a rejected token, a dead state).
        self.error: GrammarError | None = None

    def _state(self) -> GrammarState:
        if not self.session.is_running(self.request_id):
            raise GrammarNotReady(
                f"request {self.request_id!r} has no grammar state on rank {self.session.rank} "
                f"(state: {self.session.request_state(self.request_id)}); only a step "
                "decision admits it"
            )
        return self.session.state(self.request_id)

    @property
    def is_ready(self) -> bool:
        """Whether a decision admitted the request on this rank."""
        return self.session.is_running(self.request_id)

    def accept_tokens(self, request_id: str, tokens: Sequence[int]) -> bool:
        """Advance the grammar by the sampled ``tokens``, all or none.

        Parameters
        ----------
        request_id:
            vLLM passes the request id for its logs; it must be this
            grammar's.
        tokens:
            Tokens sampled this step (accepted drafts and the bonus token).

        Returns
        -------
        bool
            ``False`` when the grammar rejects a token; ``error`` then says
            why (``token_rejected``, ``grammar_terminated``,
            ``grammar_dead_state``) and the state is unchanged.
        """
        if request_id != self.request_id:
            raise ValueError(f"grammar of {self.request_id!r} asked to accept for {request_id!r}")
        self._state()
        try:
            self.session.advance(self.request_id, list(tokens))
        except GrammarError as exc:
            self.error = exc
            return False
        return True

    def validate_tokens(self, tokens: Sequence[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar accepts; the state is unchanged."""
        self._state()
        return self.session.validate_drafts(self.request_id, list(tokens))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        self._state()
        self.session.rollback(self.request_id, num_tokens)

    def fill_bitmask(self, bitmask: np.ndarray | torch.Tensor, idx: int) -> None:
        """Write the next-token mask into row ``idx`` of ``bitmask`` (int32, CPU).

        A terminated grammar gets a full row (``-1``), as in vLLM. This is
        the per-row path; ``GramcoordStructuredOutputManager.grammar_bitmask``
        is the batched one, and only it checks for stale state.
        """
        state = self._state()
        rows = bitmask.numpy() if isinstance(bitmask, torch.Tensor) else bitmask
        if state.is_terminated:
            rows[idx] = -1
            return
        state.fill_row(rows, idx)

    def is_terminated(self) -> bool:
        """Whether a stop token ended the grammar."""
        return self._state().is_terminated

    def reset(self) -> None:
        """Back to the grammar's initial state."""
        self._state().reset()

    def find_jump_string(self) -> str | None:
        """The text the grammar forces next, or ``None`` (also while gated or terminated)."""
        state = self._state()
        if not state.is_constrained or state.is_terminated:
            return None
        return state.matcher.find_jump_forward_string() or None

    def __repr__(self) -> str:
        return f"GramcoordGrammar({self.request_id!r}, ready={self.is_ready})"


class GramcoordBackend:
    """vLLM's ``StructuredOutputBackend`` role: compiles through the session.

    Parameters
    ----------
    session:
        The rank's session (a stage leader).
    owns_session:
        Whether ``destroy`` closes the session.
    """

    def __init__(self, session: RankSession, *, owns_session: bool = True) -> None:
        self.session = session
        self.owns_session = owns_session
        self.vocab_size = session.tokenizer.vocab_size
        self._anonymous = itertools.count()

    def compile_grammar(
        self,
        request_type: Any,
        grammar_spec: str,
        *,
        request_id: str | None = None,
        seq: int | None = None,
    ) -> GramcoordGrammar:
        """Start the compile of one request's grammar; never raises for bad input.

        Parameters
        ----------
        request_type:
            ``StructuredOutputOptions`` (ours or vLLM's) or its name.
        grammar_spec:
            The spec text of vLLM's key.
        request_id:
            The request; vLLM's signature has none, so without it the
            grammar gets ``grammar-<n>`` (the same on every rank when every
            rank compiles in the same order).
        seq:
            Stage 0's sequence number, on later pipeline stages.

        Returns
        -------
        GramcoordGrammar
            Pending (usable once a ``step`` decision admits it) or failed at
            once (``grammar.outcome.status == "failed"``: bad spec, poisoned
            key).
        """
        rid = request_id if request_id is not None else f"grammar-{next(self._anonymous)}"
        outcome = self.session.submit(rid, spec_from_key(request_type, grammar_spec), seq=seq)
        return GramcoordGrammar(self.session, rid, outcome)

    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        """An int32 ``[max_num_seqs, ceil(V / 32)]`` tensor of full rows (``-1``).

        As in vLLM, pass ``max_num_seqs * (1 + K)`` to hold draft rows.
        """
        return xgr.allocate_token_bitmask(max_num_seqs, self.vocab_size)

    def destroy(self) -> None:
        """Release the session's compile pool, transport and groups (if owned)."""
        if self.owns_session:
            self.session.close()
