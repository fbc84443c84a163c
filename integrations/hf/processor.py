"""The logits processor of the Hugging Face integration (see ``integrations.hf``).

``GrammarLogitsProcessor`` masks each row of one ``generate`` call with its
request's grammar. It runs no collective: ``GenerateSession.prepare`` did the
agreement before ``generate``, so the processor is safe under
``synced_gpus`` (a finished rank skips it).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import transformers

from gramcoord.rank_worker.errors import GrammarError

if TYPE_CHECKING:
    from gramcoord.integrations.hf.generate import GenerateSession

__all__ = ["FailedRows", "GrammarLogitsProcessor"]

FailedRows = Literal["eos", "free"]
# Row modes.
_FREE, _ACTIVE, _ENDED, _FAILED = "free", "active", "ended", "failed"


@dataclass(eq=False)
class _Row:
    request_id: str | None
    mode: str
    start: int | None
    seen: int = 0


class GrammarLogitsProcessor(transformers.LogitsProcessor):
    """Masks each row of one ``generate`` call with its request's grammar.

    Build it with ``GenerateSession.logits_processor`` after ``prepare``;
    use it for one ``generate`` call, then pass it to
    ``GenerateSession.finish``. ``__call__`` runs no collective (see the
    module docstring).

    Parameters
    ----------
    owner:
        The ``GenerateSession`` whose ``prepare`` admitted the requests.
    request_ids:
        One entry per batch row, in row order: a prepared request id, or
        ``None`` for an unconstrained row.
    prompt_lengths:
        Where each row's generated tokens start in ``input_ids`` (one int
        for every row, or one per row); default: the width of
        ``input_ids`` at the first call, which is right for ``generate``'s
        padded batches (left or right padding).
    failed_rows:
        ``"eos"``: rows of failed requests allow only ``stop_token_ids``
        (they end at once, empty); ``"free"``: unconstrained.
    stop_token_ids:
        The tokens ``generate`` ends a row on (pass the same ones as its
        ``eos_token_id``); default the vocabulary's stop tokens. A
        terminated row allows only these. A row that produces one that the
        grammar does not end on stops being fed (``finish_reason="stop"``).

    Attributes
    ----------
    request_ids:
        The rows' request ids.
    stop_token_ids:
        The stop tokens in use.
    failed_rows:
        The failed-row policy.
    num_calls:
        How many times ``generate`` called the processor on this rank
        (fewer than the steps of a peer whose rows finished later).

    Raises
    ------
    KeyError
        A request id that was not prepared.
    ValueError
        A request id twice, a request already used by another live
        processor, more rows than ``scheduler.max_num_seqs``, or a bad
        ``failed_rows``.
    """

    def __init__(
        self,
        owner: GenerateSession,
        request_ids: Sequence[str | None],
        prompt_lengths: int | Sequence[int] | None = None,
        *,
        failed_rows: FailedRows = "eos",
        stop_token_ids: Sequence[int] | None = None,
    ) -> None:
        if failed_rows not in ("eos", "free"):
            raise ValueError(f"failed_rows must be 'eos' or 'free', got {failed_rows!r}")
        session = owner.session
        self.request_ids = tuple(request_ids)
        limit = session.config.scheduler.max_num_seqs
        if len(self.request_ids) > limit:
            raise ValueError(
                f"{len(self.request_ids)} rows exceed scheduler.max_num_seqs={limit}; raise it "
                "in the session config"
            )
        named = [r for r in self.request_ids if r is not None]
        if len(set(named)) != len(named):
            raise ValueError("a request id appears on two rows; give each row its own request")
        for rid in named:
            rec = owner._records.get(rid)
            if rec is None:
                raise KeyError(f"request {rid!r} was not prepared (call prepare first)")
            if rec.processor is not None:
                raise ValueError(f"request {rid!r} is already used by another processor")
        if prompt_lengths is None or isinstance(prompt_lengths, numbers.Integral):
            start = None if prompt_lengths is None else int(prompt_lengths)
            starts: list[int | None] = [start] * len(self.request_ids)
        else:
            starts = [int(n) for n in prompt_lengths]
            if len(starts) != len(self.request_ids):
                raise ValueError(
                    f"{len(starts)} prompt lengths for {len(self.request_ids)} request rows"
                )
        self._owner = owner
        self._session = session
        self.failed_rows = failed_rows
        stops = tuple(stop_token_ids) if stop_token_ids is not None else session.tokenizer.stop_ids
        self.stop_token_ids = tuple(int(t) for t in stops)
        self._host_stops = frozenset(self.stop_token_ids)
        self._grammar_stops = frozenset(session.tokenizer.stop_ids)
        self._rows: list[_Row] = []
        for rid, start in zip(self.request_ids, starts):
            if rid is None:
                mode = _FREE
            else:
                rec = owner._records[rid]
                rec.processor = self
                if rec.outcome.status == "admitted" and session.masks.is_running(rid):
                    mode = _ACTIVE
                    rec.generated = True
                else:
                    mode = _FAILED
            self._rows.append(_Row(rid, mode, start))
        self._allowed: torch.Tensor | None = None
        self.num_calls = 0

    # -- the per-step call --------------------------------------------------------

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """Advance each row with its new tokens, then mask ``scores`` in place.

        Local work only: no collective, no waiting on peers.

        Raises
        ------
        ValueError
            ``input_ids`` has a different number of rows than the processor
            (beam search, ``num_return_sequences > 1``).
        """
        n = input_ids.shape[0]
        if n != len(self._rows):
            raise ValueError(
                f"generate passed {n} rows but the processor has {len(self._rows)}; use one "
                "request id per row and no beam search"
            )
        if self.num_calls == 0:
            width = input_ids.shape[1]
            for row in self._rows:
                row.seen = width if row.start is None else row.start
        self.num_calls += 1
        if any(row.mode == _ACTIVE for row in self._rows):
            self._feed_all(input_ids.detach().to("cpu"))
        active = [i for i, row in enumerate(self._rows) if row.mode == _ACTIVE]
        if active:
            self._mask(scores, active)
        forced = [
            i
            for i, row in enumerate(self._rows)
            if row.mode == _ENDED or (row.mode == _FAILED and self.failed_rows == "eos")
        ]
        if forced:
            self._force_stop(scores, forced)
        return scores

    def _mask(self, scores: torch.Tensor, active: list[int]) -> None:
        session, rows = self._session, self._rows
        ids = [rows[i].request_id for i in active]
        batch = session.masks.bitmask(ids)
        for rid, err in batch.failures.items():
            # The row's bitmask allows everything; it is forced below.
            self._fail(rows[self.request_ids.index(rid)], err.code.name, err.message)
        # Logit-row keys for the row plan: request ids, and keys no string id
        # can equal for the other rows.
        masked = set(active)
        keys: list[Any] = [
            row.request_id if i in masked else ("row", i) for i, row in enumerate(rows)
        ]
        target = scores if scores.device.type == "cpu" else scores.to("cpu", torch.float32)
        session.masks.apply(target, batch.rows, batch=keys, constrained=ids, num_drafts={})
        if target is not scores:
            scores.copy_(target.to(scores.device, scores.dtype))

    def _force_stop(self, scores: torch.Tensor, forced: list[int]) -> None:
        vocab = scores.shape[-1]
        if self._allowed is None or self._allowed.shape[0] != vocab:
            allowed = torch.zeros(vocab, dtype=torch.bool)
            ids = [t for t in self.stop_token_ids if 0 <= t < vocab]
            allowed[ids] = True
            self._allowed = allowed
        allowed = self._allowed.to(scores.device)
        index = torch.tensor(forced, device=scores.device)
        rows = scores.index_select(0, index)
        scores.index_copy_(0, index, rows.masked_fill(~allowed, float("-inf")))

    # -- feeding the grammars -------------------------------------------------------

    def _feed_all(self, ids: torch.Tensor) -> None:
        """Feed every active row the tokens past what it has seen (``ids`` on the CPU)."""
        if self.num_calls == 0:
            # finish() without any call: generation never reached a step.
            for row in self._rows:
                if row.start is not None:
                    row.seen = row.start
                else:
                    row.seen = ids.shape[1]
        width = ids.shape[1]
        for i, row in enumerate(self._rows):
            if row.mode != _ACTIVE:
                continue
            new = ids[i, row.seen :].tolist() if row.seen < width else []
            row.seen = max(row.seen, width)
            self._feed(row, new)

    def _feed(self, row: _Row, tokens: list[int]) -> None:
        session = self._session
        rid = row.request_id
        rec = self._owner._records.get(rid)
        if rec is None:  # finished meanwhile
            row.mode = _FREE
            return
        if not tokens:
            # Nothing was sampled since the last mask: the state is current.
            session.masks.advance(rid, [])
            return
        for token in tokens:
            if token in self._host_stops and token not in self._grammar_stops:
                row.mode, rec.reason = _ENDED, "stop"
                session.masks.advance(rid, [])
                return
            try:
                terminated = session.masks.advance(rid, [token])
            except GrammarError as exc:
                self._fail(row, exc.code.name, exc.message)
                return
            rec.token_ids.append(token)
            if terminated:
                # Later tokens of this row are generate's padding: never fed.
                row.mode, rec.reason = _ENDED, "grammar_end"
                return

    def _fail(self, row: _Row, code: str, message: str) -> None:
        rec = self._owner._records.get(row.request_id)
        if rec is not None and rec.error is None:
            rec.error = (code, message)
        row.mode = _FAILED
