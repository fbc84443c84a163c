"""Stage 0's side of the step loop: arrivals, admission, scheduling, outputs.

The stage-0 leader of each data-parallel replica is the scheduler of its
replica's requests. Each step it

1. submits the step's arrivals to the session (constrained requests) or
   queues them at once (unconstrained ones);
2. after the session's ``step`` (the agreement), moves admitted requests to
   the running queue and records failures;
3. plans the batch: up to ``max_num_seqs`` running requests, first come
   first served, each with the tokens it gained since its previous frame and
   the drafts to verify;
4. applies the last stage's results: output tokens, drafts, finished
   requests.

It owns the output records; nothing here talks to other ranks.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gramcoord.engine.messages import (
    Arrivals,
    BatchFrame,
    NewRequest,
    Scheduled,
    StepResults,
    Submitted,
)
from gramcoord.engine.requests import (
    EngineRequest,
    ErrorInfo,
    OutputRecord,
    failed_record,
)
from gramcoord.rank_worker.grammars.end_check import (
    MISMATCH,
    NOT_JSON,
    end_check,
    json_check,
    wants_json,
)
from gramcoord.rank_worker.grammars.outcome import Outcome
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer


@dataclass(eq=False)
class _Running:
    request: EngineRequest
    prompt_ids: tuple[int, ...]
    outcome: Outcome | None
    out: list[int] = field(default_factory=list)
    # Change since the last frame: drop ``rollback`` tokens, append ``new``.
    rollback: int = 0
    new: list[int] = field(default_factory=list)
    drafts: tuple[int, ...] = ()
    started: bool = False
    steps: int = 0
    jumped: int = 0


class Scheduler:
    """The request stream of one replica, at its stage-0 leader.

    Parameters
    ----------
    requests:
        This replica's requests, in arrival order.
    tokenizer:
        Encodes prompts and decodes outputs.
    submit:
        The session's ``submit``.
    max_num_seqs:
        Batch size limit.
    per_step:
        Arrivals per step; 0 means every request arrives at step 0.
    on_output:
        Called with each request's record as it ends (the run's journal).
    """

    def __init__(
        self,
        requests: Sequence[EngineRequest],
        tokenizer: Tokenizer,
        submit: Callable[..., Outcome],
        *,
        max_num_seqs: int,
        per_step: int = 0,
        on_output: Callable[[OutputRecord], None] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self._on_output = on_output
        self._submit = submit
        self.max_num_seqs = max_num_seqs
        self._queue = list(requests)
        self._next = 0
        self.per_step = per_step
        self.outputs: dict[str, OutputRecord] = {}
        self._pending: dict[str, _Running] = {}
        self._running: OrderedDict[str, _Running] = OrderedDict()
        self._finished_since: list[str] = []
        self.num_requests = len(self._queue)

    # -- arrivals and admission -------------------------------------------

    @property
    def idle(self) -> bool:
        """Nothing left to arrive, wait for admission or run."""
        return self._next >= len(self._queue) and not self._pending and not self._running

    def arrive(self, step: int) -> Arrivals:
        """Submit this step's arrivals; returns what later stages must add."""
        end = (
            len(self._queue)
            if not self.per_step
            else min(len(self._queue), self._next + self.per_step)
        )
        submitted: list[Submitted] = []
        for req in self._queue[self._next : end]:
            self._arrive(req, submitted)
        self._next = end
        return Arrivals(step=step, requests=tuple(submitted))

    def _arrive(self, req: EngineRequest, submitted: list[Submitted]) -> None:
        rid = req.request_id
        if rid in self.outputs or rid in self._pending or rid in self._running:
            # The session would refuse it too, but later stages must never see it.
            self.outputs.setdefault(
                rid,
                failed_record(rid, "duplicate_request_id", f"request id {rid!r} repeats"),
            )
            return
        if req.error is not None:
            self._done(failed_record(rid, "record_invalid", req.error))
            return
        try:
            rid.encode("utf-8")
        except UnicodeEncodeError:
            # The record itself must be encodable: escape the id.
            safe = rid.encode("utf-8", "backslashreplace").decode("utf-8")
            self._done(
                failed_record(
                    safe, "bad_request_id", "request id does not encode as UTF-8 (lone surrogate)"
                ),
                key=rid,
            )
            return
        try:
            prompt_ids = tuple(self.tokenizer.encode(req.prompt)) if req.prompt else ()
        except (ValueError, UnicodeError) as exc:  # e.g. lone surrogates
            self._done(failed_record(rid, "record_invalid", f"prompt not encodable: {exc}"))
            return
        if not req.constrained:
            self._running[rid] = _Running(req, prompt_ids, None)
            return
        try:
            spec_json = json.dumps(req.spec, ensure_ascii=False)
            spec_json.encode("utf-8")
        except (TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError
            self._done(failed_record(rid, "spec_bad_json", f"spec is not JSON: {exc}"))
            return
        outcome = self._submit(rid, req.spec, max_tokens=req.max_tokens)
        if outcome.status == "failed":
            self._done(
                failed_record(
                    rid,
                    outcome.code or "failed",
                    outcome.message,
                    outcome.warnings,
                    cache=outcome.cache,
                )
            )
        else:
            self._pending[rid] = _Running(req, prompt_ids, outcome)
        if outcome.seq >= 0:
            submitted.append(Submitted(rid, outcome.seq, spec_json, req.max_tokens))

    def decided(self, admitted: Sequence[Outcome], failed: Sequence[Outcome]) -> None:
        """Apply the session's step: admitted requests start running."""
        for o in admitted:
            r = self._pending.pop(o.request_id)
            r.outcome = o
            self._running[o.request_id] = r
        for o in failed:
            self._pending.pop(o.request_id, None)
            self._done(
                failed_record(
                    o.request_id,
                    o.code or "failed",
                    o.message,
                    o.warnings,
                    cache=o.cache,
                    compile_ms=o.compile_ms,
                )
            )

    # -- batches ------------------------------------------------------------

    def plan(self, step: int, *, done: bool = False) -> BatchFrame:
        """The frame of ``step``: the batch and what changed since the last one."""
        started: list[NewRequest] = []
        batch: list[Scheduled] = []
        for rid, r in list(self._running.items())[: self.max_num_seqs]:
            if not r.started:
                r.started = True
                req = r.request
                started.append(
                    NewRequest(rid, req.constrained, r.prompt_ids, req.reference, req.max_tokens)
                )
            batch.append(Scheduled(rid, r.rollback, tuple(r.new), r.drafts))
            r.rollback, r.new = 0, []
            r.steps += 1
        finished, self._finished_since = tuple(self._finished_since), []
        return BatchFrame(
            step=step, started=tuple(started), batch=tuple(batch), finished=finished, done=done
        )

    def apply(self, results: StepResults) -> None:
        """Take the last stage's results for the batch just run."""
        for res in results.results:
            r = self._running.get(res.request_id)
            if r is None:
                continue
            # plan() handed the previous change on, so this is the whole change.
            if res.rollback:
                del r.out[len(r.out) - res.rollback :]
            r.out.extend(res.tokens)
            r.rollback, r.new = res.rollback, list(res.tokens)
            r.drafts = res.drafts
            r.jumped += res.jumped
            if res.finish_reason is not None:
                self._finish(r, res)

    def _finish(self, r: _Running, res) -> None:
        rid = r.request.request_id
        del self._running[rid]
        self._finished_since.append(rid)
        o = r.outcome
        facts = dict(
            warnings=o.warnings if o else (),
            cache=o.cache if o else "none",
            compile_ms=o.compile_ms if o else 0.0,
            model_steps=r.steps,
            jump_forward_tokens=r.jumped,
        )
        stops = set(self.tokenizer.stop_ids)
        text = self.tokenizer.decode([t for t in r.out if t not in stops])
        error = ErrorInfo(res.error_code, res.error_message) if res.error_code else None
        finished = error is None and o is not None and res.finish_reason in ("grammar_end", "stop")
        if finished and wants_json(r.request.spec):
            why = json_check(text)
            facts["json_check"] = "passed" if why is None else "failed"
            if why is not None:  # never "ok": a grammar let through what is not JSON
                error = ErrorInfo(NOT_JSON, why)
        if error is None and finished and o.end_check is not None:
            why = end_check(o.end_check, text)
            facts["end_check"] = "passed" if why is None else "failed"
            if why is not None:  # never "ok": the grammar let it through, the schema does not
                error = ErrorInfo(MISMATCH, why)
        self._done(
            OutputRecord(
                id=rid,
                status="failed" if error else "ok",
                finish_reason=res.finish_reason,
                text=text,
                token_ids=list(r.out),
                error=error,
                **facts,
            )
        )

    def _done(self, record: OutputRecord, *, key: str | None = None) -> None:
        """A request ended: keep its record and hand it to the journal.

        A record filed under another ``key`` (an id that is not valid
        Unicode, escaped) is not journaled: a resumed run fails it again.
        """
        self.outputs[record.id if key is None else key] = record
        if self._on_output is not None and key is None:
            self._on_output(record)

    @property
    def num_finished(self) -> int:
        return len(self.outputs)
