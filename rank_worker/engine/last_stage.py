"""The last pipeline stage's step: logits, masks, sampling, acceptance.

Every rank of the last stage runs ``LastStage.run`` on the step's
``BatchFrame``:

- the **leader** builds the bitmask rows on a thread while the logits are
  computed (DESIGN section 1, step 5; a batch of fewer than
  ``OVERLAP_FROM_ROWS`` rows inline, before them), publishes them to its TP workers,
  applies its own copy, samples, and then accepts the tokens into the
  grammars, runs jump-forward, decides who finished and proposes the next
  drafts; it returns the ``StepResults`` for stage 0;
- a **TP worker** computes the same logits, receives the rows, applies them,
  samples, and keeps its copy of each output from the frames.

Then all TP ranks compare what they sampled and the digest of the rows they
applied (one posted ``all_gather`` on the stage's tp group every
``distributed.tp_check_steps`` steps). A difference is a
``DeterminismError`` that names the rank, the step, the request and the
position.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from gramcoord.rank_worker.engine.acceptance import accepted_tokens, finish_reason
from gramcoord.rank_worker.engine.frames import BatchFrame, StepResults, TokenResult
from gramcoord.rank_worker.engine.models import LogitsSource, ModelRequest
from gramcoord.rank_worker.engine.sampler import Sampler
from gramcoord.rank_worker.engine.timings import Timings
from gramcoord.rank_worker.errors import DeterminismError, GrammarError
from gramcoord.rank_worker.masks.jump_forward import retokenize_plan
from gramcoord.rank_worker.session.session import MaskBatch, RankSession

# Mask rows from which the build runs on a thread while the logits are
# computed; below, inline before them (``gramcoord bench step``, README).
OVERLAP_FROM_ROWS = 16


@dataclass(eq=False)
class _View:
    request: ModelRequest
    constrained: bool
    max_tokens: int
    out: list[int] = field(default_factory=list)
    drafter: object | None = None


class LastStage:
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
    ) -> None:
        self.session = session
        self.model = model
        self.sampler = sampler
        self.timings = timings
        self.make_drafter = make_drafter
        self.leader = session.is_leader
        self.stop_ids = frozenset(session.tokenizer.stop_ids)
        self.views: dict[str, _View] = {}
        self.k = session.k
        # Fault injection (``faults.flip_mask_bit``): flip one bit of the
        # first row applied at or after this step, so the determinism check
        # must catch it; -1 when unset.
        self._flip_step = session.faults.flip_step
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mask-build") if self.leader else None
        # Failures of this stage's admission (e.g. grammar_stage_timeout).
        self.stage_failures: dict[str, tuple[str, str]] = {}
        # The TP check (see _check_tp): this window's rows and row positions,
        # and the window posted before it, still in flight.
        self._tp_every = session.config.distributed.tp_check_steps
        self._tp_rows: list[tuple[int, int, int]] = []
        self._tp_positions: list[list[tuple[str, int, int]]] = []
        self._tp_pending = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

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
                    self.session.applier.digests.truncate(s.request_id, len(v.out))
                v.out.extend(s.new_tokens)
        for rid in frame.finished:
            self.views.pop(rid, None)
        if self.leader:
            return self._leader_step(frame)
        self._worker_step(frame)
        return None

    def _leader_step(self, frame: BatchFrame) -> StepResults:
        session = self.session
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
            if v.constrained and not session.is_running(s.request_id):
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
        if self.session.channel is not None:
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
        masks = self.session.bitmask(constrained, drafts)
        t1 = time.perf_counter()
        self.session.publish(step, masks)
        return masks, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3

    def _worker_step(self, frame: BatchFrame) -> None:
        reader = self.session.reader
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
                self.session.applier.commit(
                    s.request_id, len(v.out), row_digests[s.request_id][: len(acc)]
                )
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
        session = self.session
        if 0 <= self._flip_step <= step and len(rows):
            # The first step at or after the target that masks anything.
            self._flip_step = -1
            rows = rows.copy()
            rows[0, 0] ^= 1
        t0 = time.perf_counter()
        batch = [s.request_id for s in runnable]
        num_drafts = {s.request_id: len(s.drafts) for s in runnable}
        step_digest, row_digests = session.apply(
            logits, rows, batch=batch, constrained=constrained, num_drafts=num_drafts
        )
        self.timings.add("apply", (time.perf_counter() - t0) * 1e3)
        keys = []
        for s in runnable:
            base = len(self.views[s.request_id].out)
            keys.extend((s.request_id, base + i) for i in range(len(s.drafts) + 1))
        picks = self.sampler.sample(logits, keys)
        self._check_tp(step, picks, step_digest, runnable, row_digests)
        return picks, row_digests

    def _check_tp(self, step, picks, step_digest, runnable, row_digests) -> None:
        """Add this step to the TP cross-check; post a window of steps every few steps.

        Every TP rank of the stage keeps ``[step, hash(picks), step digest]``
        per step and, every ``distributed.tp_check_steps`` steps, posts the
        window in one ``all_gather`` without waiting; the window posted
        before is settled then. A rank never waits on its peers here unless
        it runs a window ahead, and a difference is reported within two
        windows, naming the first step and row that differed.
        """
        runtime = self.session.runtime
        if runtime is None or self.session.layout.tp == 1:
            return
        h = hash(tuple(picks)) & 0x7FFFFFFFFFFFFFFF
        self._tp_rows.append((step, h, step_digest))
        self._tp_positions.append(self._row_positions(runnable, row_digests))
        if len(self._tp_rows) >= self._tp_every:
            self._post_tp_check()

    def _post_tp_check(self) -> None:
        self._settle_posted()
        rows, self._tp_rows = self._tp_rows, []
        positions, self._tp_positions = self._tp_positions, []
        flat = np.array(rows, dtype=np.int64).reshape(-1)
        pending = self.session.runtime.all_gather_start(
            "tp", flat, operation="tp sample check", step=rows[-1][0]
        )
        self._tp_pending = (pending, rows, positions)

    def settle_tp_check(self) -> None:
        """Wait for the last posted TP check; raise ``DeterminismError`` if it differed.

        The step loop calls it once more after its last step (it posts what
        is left of the window first, on every TP rank alike).
        """
        if self._tp_rows:
            self._post_tp_check()
        self._settle_posted()

    def _settle_posted(self) -> None:
        if self._tp_pending is None:
            return
        (pending, rows, positions), self._tp_pending = self._tp_pending, None
        got = pending.wait()
        if (got == got[0]).all():
            return
        per_step = got.reshape(len(got), len(rows), 3)
        i = int(np.flatnonzero((per_step != per_step[0]).any(axis=(0, 2)))[0])
        step = rows[i][0]
        runtime = self.session.runtime
        ranks = runtime.members("tp")
        odd = tuple(r for r, g in zip(ranks, per_step[:, i]) if not (g == per_step[0, i]).all())
        rid, pos = self._first_difference(step, positions[i])
        raise DeterminismError(
            f"[rank {self.session.rank}] step {step}: TP ranks {list(odd)} sampled or "
            f"masked differently from rank {ranks[0]}; first differing row: request {rid!r}, "
            f"position {pos}",
            ranks=odd,
            request_id=rid,
            position=pos,
        )

    def _row_positions(self, runnable, row_digests) -> list[tuple[str, int, int]]:
        """(request, position, digest) of every digested row of this step."""
        rows = []
        for s in runnable:
            base = len(self.views[s.request_id].out)
            for i, d in enumerate(row_digests.get(s.request_id, ())):
                rows.append((s.request_id, base + i, d))
        return rows

    def _first_difference(self, step, rows) -> tuple[str, int]:
        """Only after a mismatch: exchange the rows' digests to name the first that differs."""
        flat = np.zeros(self.session.config.scheduler.max_num_seqs * (1 + self.k), np.int64)
        flat[: len(rows)] = [d for _, _, d in rows]
        got = self.session.runtime.all_gather("tp", flat, operation="tp digest exchange", step=step)
        for j, (rid, pos, _) in enumerate(rows):
            if not (got[:, j] == got[0, j]).all():
                return rid, pos
        return ("<sampled tokens>", -1)

    # -- acceptance (leader) ------------------------------------------------------

    def _drop(self, rid: str) -> None:
        self.views.pop(rid, None)
        self.session.finish(rid)

    def _accept(self, rid, drafts, picks, row_digests, masks: MaskBatch) -> TokenResult:
        session, v = self.session, self.views[rid]
        before = list(v.out)
        if rid in masks.failures:
            err = masks.failures[rid]
            session.finish(rid)
            self.views.pop(rid)
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
            session.applier.commit(rid, len(v.out), row_digests[rid][: len(acc)])
        terminated = False
        try:
            if v.constrained:
                terminated = session.advance(rid, acc)
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
            jr = session.jump_forward(rid, v.out)
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
                    proposal = session.validate_drafts(rid, proposal)
                next_drafts = tuple(proposal)
        rollback, tokens = retokenize_plan(before, v.out)
        if rollback:
            # Retokenization replaced committed positions: their rows will be
            # masked again from the new tokens (workers do the same).
            session.applier.digests.truncate(rid, len(before) - rollback)
        if reason is not None:
            self._drop(rid)
        return TokenResult(rid, rollback, tuple(tokens), next_drafts, reason, jumped=jumped)
