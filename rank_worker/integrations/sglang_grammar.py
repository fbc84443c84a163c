"""SGLang's grammar objects, backed by the request's state in a ``RankSession``.

``SGLangGrammar`` has the methods of SGLang's ``BaseGrammarObject``
(``accept_token``, ``rollback``, ``is_terminated``, the vocab-mask calls,
``copy``, jump-forward); ``gramcoord.rank_worker.integrations.sglang_manager``
holds the manager that creates them and the map of every call to its SGLang
call site.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
import xgrammar as xgr

from gramcoord.rank_worker.errors import ErrorCode, GrammarError
from gramcoord.rank_worker.masks.grammar_state import GrammarState, live_rows
from gramcoord.rank_worker.masks.jump_forward import JumpForward, JumpResult, retokenize_plan
from gramcoord.rank_worker.session.session import RankSession

__all__ = [
    "ANY_JSON",
    "GrammarFailure",
    "GrammarRequest",
    "SGLangGrammar",
    "StageMismatch",
    "TokenRejected",
    "spec_from_sampling_params",
]


# SGLang's json_schema value for "any JSON".
ANY_JSON = "$$ANY$$"

# SamplingParams fields in SGLang's order of precedence -> the gramcoord spec.
_SPEC_FIELDS = (
    ("json_schema", "json"),
    ("regex", "regex"),
    ("ebnf", "grammar"),
    ("structural_tag", "structural_tag"),
)


class _AbortAll(NamedTuple):
    """An ``AbortReq`` that aborts every queued request (``close``)."""

    rid: str = ""
    abort_all: bool = True


_ABORT_ALL = _AbortAll()


class GrammarRequest(Protocol):
    """What the manager uses of SGLang's ``Req``."""

    rid: str
    # Has SGLang's json_schema / regex / ebnf / structural_tag fields.
    sampling_params: Any
    # Set by the manager: an ``SGLangGrammar``, or None.
    grammar: Any

    def set_finish_with_abort(self, error_msg: str) -> None:
        """Finish the request with an error (SGLang's ``Req`` method)."""
        ...


class TokenRejected(ValueError):
    """The grammar refused a token; SGLang catches ``ValueError`` and aborts the request.

    Attributes
    ----------
    request_id:
        The request.
    code:
        ``token_rejected``, ``grammar_dead_state`` or ``grammar_terminated``.
    message:
        What was refused.
    """

    def __init__(self, request_id: str, code: str, message: str) -> None:
        super().__init__(f"request {request_id!r}: {code}: {message}")
        self.request_id = request_id
        self.code = code
        self.message = message


class StageMismatch(RuntimeError):
    """Stage 0 submitted a request this pipeline stage was never given.

    The stage would follow decisions about a request it cannot schedule, and
    its batches would differ from stage 0's (sglang#28424).
    """


class GrammarFailure(NamedTuple):
    """A request that left the grammar queue failed."""

    request_id: str
    seq: int
    code: str
    message: str
    # Admitted by stage 0 but failed on this later stage alone (its compile
    # did not finish in time): the host must end it on stage 0 as well.
    stage_only: bool = False


def spec_from_sampling_params(params: Any) -> dict[str, Any] | None:
    """The gramcoord spec of SGLang sampling params, or ``None`` when unconstrained.

    Parameters
    ----------
    params:
        An object with SGLang's ``json_schema``, ``regex``, ``ebnf`` and
        ``structural_tag`` attributes (missing ones count as unset). The
        first one set wins, in that order, as in SGLang.

    Returns
    -------
    dict or None
        A ``structured_outputs`` mapping (vLLM field names).
    """
    for name, kind in _SPEC_FIELDS:
        value = getattr(params, name, None)
        if value is None:
            continue
        if name == "json_schema" and value == ANY_JSON:
            return {"json_object": True}
        if name == "ebnf":
            return {"grammar": value, "grammar_syntax": "ebnf"}
        return {kind: value}
    return None


class SGLangGrammar:
    """One request's grammar, with the methods of SGLang's ``BaseGrammarObject``.

    Made by ``SGLangGrammarManager`` when a request is admitted, or by
    ``copy``. On the last pipeline stage's leader it is *bound*: it drives
    the session's own state for the request, so masks go through
    ``RankSession.bitmask`` (which refuses a mask whose sampled token was
    never accepted) and tokens through ``RankSession.advance``. Elsewhere
    (earlier stages, copies, finished requests) it holds its own state over
    the same compiled grammar.

    Attributes
    ----------
    request_id:
        The request.
    state:
        The grammar state (an xgrammar matcher behind the reasoning gate).
    accepted_tokens:
        Tokens accepted so far, as in SGLang's ``XGrammarGrammar``.
    finished:
        Set by the host after each accepted token (``req.finished()``); the
        manager releases finished grammars at its next get-ready call.
    dead:
        Set when a mask found no allowed token: the next ``accept_token``
        raises ``TokenRejected`` with code ``grammar_dead_state``.
    warnings:
        Warning codes of the spec (e.g. ``unconstrained_ref``).
    """

    def __init__(
        self,
        state: GrammarState,
        *,
        request_id: str,
        session: RankSession | None = None,
        jump: JumpForward | None = None,
        warnings: tuple[str, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.state = state
        self._session = session
        self._jump = jump
        self.accepted_tokens: list[int] = []
        self.finished = False
        self.dead: GrammarError | None = None
        self.warnings = warnings
        self._row: np.ndarray | None = None

    @property
    def is_bound(self) -> bool:
        """Whether masks and tokens go through the session."""
        return self._session is not None

    def _unbind(self) -> None:
        self._session = None

    # -- tokens -------------------------------------------------------------

    def accept_token(self, token: int) -> None:
        """Accept one sampled token.

        A token offered after the grammar terminated is ignored, as SGLang's
        xgrammar backend does.

        Raises
        ------
        TokenRejected
            The grammar refused it, or the last mask was a dead state; the
            state is unchanged.
        """
        if self.dead is not None:
            raise TokenRejected(self.request_id, self.dead.code.name, self.dead.message)
        if self.state.is_terminated:
            return
        self._advance([int(token)])

    def _advance(self, tokens: list[int]) -> None:
        try:
            if self._session is not None:
                self._session.advance(self.request_id, tokens)
            else:
                self.state.accept_tokens(tokens)
        except GrammarError as exc:
            raise TokenRejected(self.request_id, exc.code.name, exc.message) from exc
        self.accepted_tokens.extend(tokens)

    def rollback(self, k: int) -> None:
        """Undo the last ``k`` accepted tokens.

        Raises
        ------
        ValueError
            More tokens than were accepted.
        """
        if k <= 0:
            return
        if self._session is not None:
            self._session.rollback(self.request_id, k)
        else:
            self.state.rollback(k)
        del self.accepted_tokens[-k:]
        self.dead = None

    def is_terminated(self) -> bool:
        """Whether the grammar accepted a stop token."""
        return self.state.is_terminated

    # -- masks --------------------------------------------------------------

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device: Any) -> torch.Tensor:
        """An int32 ``[batch_size, ceil(vocab_size / 32)]`` CPU mask allowing every token.

        Rows that are never filled (unconstrained requests) stay all-allowed.
        ``device`` is ignored: SGLang fills on the host, then calls
        ``move_vocab_mask``.
        """
        return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        """Write this request's next-token mask into row ``idx`` of ``vocab_mask``.

        Tokens past the grammar's vocabulary are disallowed. A dead state
        (no token allowed) leaves the row all-allowed and sets ``dead``, so
        the batch still samples and the next ``accept_token`` fails the
        request.

        Raises
        ------
        StaleGrammarState
            Bound grammars: the previous mask's token was never accepted.
        """
        if self._session is not None:
            built = self._session.bitmask([self.request_id])
            row = built.rows[0]
            self.dead = built.failures.get(self.request_id)
        else:
            row = self._own_row()
        width = min(vocab_mask.shape[-1], row.shape[-1])
        vocab_mask[idx, :width].copy_(torch.from_numpy(row[:width]))
        vocab_mask[idx, width:] = 0

    def _own_row(self) -> np.ndarray:
        words = (self.state.vocab_size + 31) // 32
        if self._row is None:
            self._row = np.empty((1, words), dtype=np.int32)
        row = self._row
        try:
            if self.state.fill_row(row, 0) and not live_rows(row, self.state.vocab_size)[0]:
                raise GrammarError(ErrorCode.grammar_dead_state, "the grammar allows no token")
        except GrammarError as exc:
            self.dead = exc
            row[0] = -1
        return row[0]

    @staticmethod
    def move_vocab_mask(vocab_mask: torch.Tensor, device: Any) -> torch.Tensor:
        """``vocab_mask`` on ``device`` (a non-blocking copy)."""
        return vocab_mask.to(device, non_blocking=True)

    @staticmethod
    def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        """Set the logits of disallowed tokens to ``-inf``, in place (any device)."""
        xgr.apply_token_bitmask_inplace(logits, vocab_mask.to(logits.device, non_blocking=True))

    # -- copies and jump-forward -------------------------------------------

    def copy(self) -> SGLangGrammar:
        """An independent grammar at the same state, outside the session.

        Advancing or rolling back the copy never moves this grammar.
        """
        matcher = self.state.matcher.fork()
        matcher.reset()
        state = GrammarState.from_matcher(
            matcher, vocab_size=self.state.vocab_size, gate=self.state.gate
        )
        state.accept_tokens(self.accepted_tokens)
        twin = SGLangGrammar(
            state, request_id=self.request_id, jump=self._jump, warnings=self.warnings
        )
        twin.accepted_tokens = list(self.accepted_tokens)
        twin.finished = self.finished
        return twin

    def try_jump_forward(self, tokenizer: Any = None) -> tuple[list[int], str] | None:
        """The grammar-forced text now, as SGLang's helper ``(token ids, text)``.

        Nothing changes. ``None`` when nothing is forced or jump-forward is
        off (``grammar.jump_forward``). In exact mode (the default) the text
        stops where a token could span into free text. ``tokenizer`` is
        unused: the session's vocabulary encodes.
        """
        if self._jump is None:
            return None
        plan = self._jump.plan(self.state, self.accepted_tokens)
        return None if plan is None else (list(plan.tokens), plan.forced)

    def jump_forward_str_state(self, helper: tuple[list[int], str]) -> tuple[str, int]:
        """The text to append for ``helper``, and SGLang's unused next state (-1)."""
        return helper[1], -1

    def jump_and_retokenize(
        self, old_output_ids: Sequence[int], new_output_ids: Sequence[int], next_state: int
    ) -> None:
        """Follow the host's retokenized output: roll back to the common prefix, accept the rest.

        Raises
        ------
        TokenRejected
            The new tokens do not fit the grammar; the state is put back.
        """
        num_rollback, suffix = retokenize_plan(list(old_output_ids), list(new_output_ids))
        removed = self.accepted_tokens[len(self.accepted_tokens) - num_rollback :]
        self.rollback(num_rollback)
        try:
            self._advance([int(t) for t in suffix])
        except TokenRejected:
            self._advance(removed)
            raise

    def jump_forward(self) -> JumpResult | None:
        """gramcoord's jump-forward in one call (``RankSession.jump_forward``).

        Appends the forced tokens to ``accepted_tokens`` (after dropping
        ``num_rollback`` of them in greedy mode); the host applies the same
        change to its output ids.

        Returns
        -------
        JumpResult or None
            What was done, or ``None`` when nothing is forced or the
            feature is off.
        """
        if self._session is not None:
            return self._session.jump_forward(self.request_id, self.accepted_tokens)
        if self._jump is None:
            return None
        return self._jump.jump(self.state, self.accepted_tokens)

    def __repr__(self) -> str:
        return (
            f"SGLangGrammar({self.request_id!r}, bound={self.is_bound}, "
            f"tokens={len(self.accepted_tokens)}, terminated={self.is_terminated()})"
        )
