"""The last pipeline stage's step: logits, masks, sampling, acceptance.

Every rank of the last stage runs ``ModelRunner.run`` on the step's
``BatchFrame``:

- the **leader** builds the bitmask rows on a thread while the logits are
  computed (docs/design.md, "One step of our own loop"; a batch of fewer than
  ``OVERLAP_FROM_ROWS`` rows inline, before them), publishes them to its TP workers,
  applies its own copy, samples, and then accepts the tokens into the
  grammars, runs jump-forward, decides who finished and proposes the next
  drafts; it returns the ``StepResults`` for stage 0;
- a **TP worker** computes the same logits, receives the rows, applies them,
  samples, and keeps its copy of each output from the frames.

Then all TP ranks compare what they sampled and the digest of the rows they
applied (``TpCheck``, one posted ``all_gather`` every
``distributed.tp_check_steps`` steps).

The leader uses the session's ``leader`` and ``masks`` roles, a worker its
``reader``; nothing else of the session but its context.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from gramcoord.engine.acceptance import accepted_tokens, finish_reason
from gramcoord.engine.messages import BatchFrame, StepResults, TokenResult
from gramcoord.engine.models import LogitsSource, ModelRequest
from gramcoord.engine.sampler import Sampler
from gramcoord.engine.timings import Timings
from gramcoord.rank_worker.errors import DeterminismError, GrammarError
from gramcoord.rank_worker.masks.jump_forward import retokenize_plan
from gramcoord.rank_worker.session.session import MaskBatch, RankSession
from gramcoord.rank_worker.session.tp_check import TpCheck, TpMismatch

# Mask rows from which the build runs on a thread while the logits are
# computed; below, inline before them (``gramcoord bench step``, docs/performance.md).
OVERLAP_FROM_ROWS = 16


@dataclass(eq=False)
class _View:
    request: ModelRequest
    constrained: bool
    max_tokens: int
    out: list[int] = field(default_factory=list)
    drafter: object | None = None


class ModelRunner:
    """One last-stage rank's part of each step; see the module docstring.

    Parameters
    ----------
    session:
        This rank's session (a last-stage rank).
    model:
        The logits source (identical on every rank).
    sampler:
        Greedy or seeded sampling (identical on every rank).
    make_drafter:
        Leader only: ``ModelRequest -> Drafter | None``.
    """

    def __init__(
        self,
        session: RankSession,
        model: LogitsSource,
        sampler: Sampler,
        timings: Timings,
        *,
        make_drafter: Callable[[ModelRequest], object | None] | None = None,
        on_request_end: Callable[[str, list[tuple[int, int]]], None] | None = None,
    ) -> None:
        self.session = session
        self._on_end = on_request_end
        self.leader = session.is_leader
        if self.leader:
            self._stage = session.leader
            self._masks = self.rows = session.masks
        else:
            self.rows = self._reader = session.reader
        self.model = model
        self.sampler = sampler
        self.timings = timings
        self.make_drafter = make_drafter
        self.stop_ids = frozenset(session.tokenizer.stop_ids)
        self.views: dict[str, _View] = {}
        self.k = session.config.speculative.num_tokens
        # Fault injection (``faults.flip_mask_bit``): flip one bit of the
        # first row applied at or after this step, so the determinism check
        # must catch it; -1 when unset.
        self._flip_step = session.faults.flip_step
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mask-build") if self.leader else None
        # Failures of this stage's admission (e.g. grammar_stage_timeout).
        self.stage_failures: dict[str, tuple[str, str]] = {}
        self._tp_check = None
        if session.runtime is not None and session.layout.tp > 1:
            self._tp_check = TpCheck(
                session.runtime,
                session.rank,
                every=session.config.distributed.tp_check_steps,
                max_rows=session.config.scheduler.max_num_seqs * (1 + self.k),
            )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def settle_tp_check(self) -> None:
        """Wait for the last TP check (the loop calls it after its last step)."""
        if self._tp_check is not None:
            self._raise(self._tp_check.settle())

    def _raise(self, found: TpMismatch | None) -> None:
        """A TP rank masked or sampled differently: the run ends (exit status 3)."""
        if found is not None:
            raise DeterminismError(
                f"[rank {self.session.rank}] {found.describe(self._tp_check.first)}",
                ranks=found.ranks,
                request_id=found.request_id,
                position=found.position,
            )

    # -- one step ---------------------------------------------------------------

    def run(self, frame: BatchFrame) -> StepResults | None:
        for nr in frame.started:
            req = ModelRequest(nr.request_id, nr.prompt_ids, nr.reference)
            drafter = self.make_drafter(req) if self.make_drafter is not None else None
            self.views[nr.request_id] = _View(req, nr.constrained, nr.max_tokens, drafter=drafter)
        if not self.leader:
            for s in frame.batch:
                v = self.views[s.request_id]
                if s.rollback:
                    del v.out[len(v.out) - s.rollback :]
                    self.rows.truncate(s.request_id, len(v.out))
                v.out.extend(s.new_tokens)
        for rid in frame.finished:
            if self.views.pop(rid, None) is not None and not self.leader:
                self._ended(rid)
        if self.leader:
            return self._leader_step(frame)
        self._worker_step(frame)
        return None

    def _leader_step(self, frame: BatchFrame) -> StepResults:
        for f in frame.failed_upstream:
            self.stage_failures.setdefault(f.request_id, (f.code, f.message))
        # Report a stage failure once the request has started here; keep the
        # others until it does.
        errors = {r: e for r, e in self.stage_failures.items() if r in self.views}
        for rid in errors:
            del self.stage_failures[rid]
        runnable = []
        for s in frame.batch:
            v = self.views[s.request_id]
            if s.request_id in errors:
                continue
            if v.constrained and not self._masks.is_running(s.request_id):
                errors[s.request_id] = ("grammar_stage_timeout", "not compiled on the last stage")
                continue
            runnable.append(s)
        constrained = [s.request_id for s in runnable if self.views[s.request_id].constrained]
        drafts = {s.request_id: s.drafts for s in runnable}
        args = (frame.step, constrained, [drafts[r] for r in constrained])
        if len(constrained) * (1 + self.k) < OVERLAP_FROM_ROWS:
            # A few rows fill in tens of microseconds: handing them to the
            # build thread and back costs more than it overlaps.
            masks, build_ms, publish_ms = self._build(*args)
            t0 = time.perf_counter()
            logits = self._logits(runnable)
            t1 = time.perf_counter()
        else:
            t0 = time.perf_counter()
            build = self._pool.submit(self._build, *args)
            logits = self._logits(runnable)
            t1 = time.perf_counter()
            masks, build_ms, publish_ms = build.result()
        self.timings.add("forward", (t1 - t0) * 1e3)
        self.timings.add("mask_build", build_ms)
        if self.session.layout.tp > 1:
            self.timings.add("transport", publish_ms)
        picks, row_digests = self._mask_and_sample(
            frame.step, logits, runnable, constrained, masks.rows
        )
        results = [
            TokenResult(rid, 0, (), finish_reason="error", error_code=c, error_message=m)
            for rid, (c, m) in errors.items()
        ]
        for rid in errors:
            self._drop(rid)
        offset = 0
        for s in runnable:
            n = 1 + len(s.drafts)
            results.append(
                self._accept(s.request_id, s.drafts, picks[offset : offset + n], row_digests, masks)
            )
            offset += n
        return StepResults(step=frame.step, results=tuple(results))

    def _build(self, step: int, constrained: list[str], drafts: list[tuple[int, ...]]):
        t0 = time.perf_counter()
        masks = self._masks.bitmask(constrained, drafts)
        t1 = time.perf_counter()
        self._masks.publish(step, masks)
        return masks, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3

    def _worker_step(self, frame: BatchFrame) -> None:
        reader = self._reader
        t0 = time.perf_counter()
        got = reader.receive(frame.step)
        self.timings.add("transport", (time.perf_counter() - t0) * 1e3)
        try:
            constrained = list(got.request_ids)
            keep = set(constrained)
            runnable = [
                s
                for s in frame.batch
                if not self.views[s.request_id].constrained or s.request_id in keep
            ]
            logits = self._logits(runnable)
            picks, row_digests = self._mask_and_sample(
                frame.step, logits, runnable, constrained, got.rows
            )
        finally:
            # (Fault injection: a stalled reader keeps its slots; a later
            # release gives back every earlier step too.)
            faults = self.session.faults
            if faults.stall is None or not faults.holds_slot(frame.step):
                reader.release(frame.step)
        offset = 0
        for s in runnable:
            n = 1 + len(s.drafts)
            v = self.views[s.request_id]
            room = v.max_tokens - len(v.out)
            acc = accepted_tokens(picks[offset : offset + n], s.drafts, self.stop_ids, room)
            if s.request_id in row_digests:
                reader.commit(s.request_id, len(v.out), row_digests[s.request_id][: len(acc)])
            offset += n

    # -- shared parts -------------------------------------------------------------

    def _logits(self, runnable):
        rows = []
        for s in runnable:
            v = self.views[s.request_id]
            for i in range(len(s.drafts) + 1):
                rows.append((v.request, v.out + list(s.drafts[:i])))
        return self.model.logits(rows)

    def _mask_and_sample(self, step, logits, runnable, constrained, rows: np.ndarray):
        if 0 <= self._flip_step <= step and len(rows):
            # The first step at or after the target that masks anything.
            self._flip_step = -1
            rows = rows.copy()
            rows[0, 0] ^= 1
        t0 = time.perf_counter()
        batch = [s.request_id for s in runnable]
        num_drafts = {s.request_id: len(s.drafts) for s in runnable}
        step_digest, row_digests = self.rows.apply(
            logits, rows, batch=batch, constrained=constrained, num_drafts=num_drafts
        )
        self.timings.add("apply", (time.perf_counter() - t0) * 1e3)
        keys = []
        for s in runnable:
            base = len(self.views[s.request_id].out)
            keys.extend((s.request_id, base + i) for i in range(len(s.drafts) + 1))
        picks = self.sampler.sample(logits, keys)
        if self._tp_check is not None:
            positions = self._row_positions(runnable, row_digests)
            self._raise(self._tp_check.add(step, step_digest, positions, picks))
        return picks, row_digests

    def _row_positions(self, runnable, row_digests) -> list[tuple[str, int, int]]:
        """(request, position, digest) of every digested row of this step (the TP check)."""
        rows = []
        for s in runnable:
            base = len(self.views[s.request_id].out)
            for i, d in enumerate(row_digests.get(s.request_id, ())):
                rows.append((s.request_id, base + i, d))
        return rows

    # -- acceptance (leader) ------------------------------------------------------

    def _drop(self, rid: str) -> None:
        self.views.pop(rid, None)
        self._stage.release(rid)
        self._ended(rid)

    def _ended(self, rid: str) -> None:
        """A request left this rank: its committed rows go to the journal."""
        if self._on_end is not None:
            self._on_end(rid, self.rows.digests.rows_of(rid))

    def _accept(self, rid, drafts, picks, row_digests, masks: MaskBatch) -> TokenResult:
        roles, v = self._masks, self.views[rid]
        before = list(v.out)
        if rid in masks.failures:
            err = masks.failures[rid]
            self._drop(rid)
            return TokenResult(
                rid,
                0,
                (),
                finish_reason="error",
                error_code=err.code.name,
                error_message=err.message,
            )
        acc = accepted_tokens(picks, drafts, self.stop_ids, v.max_tokens - len(v.out))
        if v.constrained:
            roles.commit(rid, len(v.out), row_digests[rid][: len(acc)])
        terminated = False
        try:
            if v.constrained:
                terminated = roles.advance(rid, acc)
        except GrammarError as exc:
            self._drop(rid)
            return TokenResult(
                rid,
                0,
                (),
                finish_reason="error",
                error_code=exc.code.name,
                error_message=exc.message,
            )
        v.out.extend(acc)
        reason = finish_reason(
            terminated=terminated,
            accepted=acc,
            stop_ids=self.stop_ids,
            length=len(v.out),
            max_tokens=v.max_tokens,
        )
        jumped = 0
        next_drafts: tuple[int, ...] = ()
        if reason is None and v.constrained:
            length = len(v.out)
            jr = roles.jump_forward(rid, v.out)
            if jr is not None:
                if len(v.out) >= v.max_tokens:
                    del v.out[v.max_tokens :]
                    reason = "length"
                jumped = max(0, len(v.out) - length)
        if reason is None and v.drafter is not None:
            room = min(self.k, v.max_tokens - len(v.out) - 1)
            if room > 0:
                proposal = v.drafter.propose(v.out, room)[:room]
                if v.constrained:
                    proposal = roles.validate_drafts(rid, proposal)
                next_drafts = tuple(proposal)
        rollback, tokens = retokenize_plan(before, v.out)
        if rollback:
            # Retokenization replaced committed positions: their rows will be
            # masked again from the new tokens (workers do the same).
            roles.truncate(rid, len(before) - rollback)
        if reason is not None:
            self._drop(rid)
        return TokenResult(rid, rollback, tuple(tokens), next_drafts, reason, jumped=jumped)
