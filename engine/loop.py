"""The per-rank step loop: every rank runs ``run_loop`` with its session.

The roles (docs/design.md, "One step of our own loop"):

- **the scheduler**, the stage-0 leader of a replica: submits arrivals, runs the
  agreement (``session.leader.step``), plans the batch and sends it on, then takes
  the last stage's results (``Scheduler``);
- **later stage leaders**: add stage 0's arrivals with stage 0's sequence
  numbers, follow the decision, forward the batch, and on the last stage
  build masks and accept tokens (``ModelRunner``);
- **TP workers**: take the batch from the rank before them (their leader
  on stage 0, else the same tp index on the previous stage), pass it on, and
  on the last stage compute, mask and sample (``ModelRunner``).

Every rank leaves the loop after the same step: stage 0 marks the last
frame ``done`` once every replica is idle (with partitioned replicas, the
end-of-run vote on the posted poison exchange, ``poison_lag_steps`` after
the step that voted), and the frame reaches every rank.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence

import msgspec

from gramcoord.engine import messages
from gramcoord.engine.drafter import make_drafter
from gramcoord.engine.messages import Arrivals, BatchFrame, StageFailure, StepResults
from gramcoord.engine.model_runner import ModelRunner
from gramcoord.engine.models import LogitsSource
from gramcoord.engine.requests import EngineRequest, OutputRecord
from gramcoord.engine.sampler import Sampler
from gramcoord.engine.scheduler import Scheduler
from gramcoord.engine.timings import Timings
from gramcoord.rank_worker.config import SpeculativeConfig
from gramcoord.rank_worker.session.digest import DigestRecord
from gramcoord.rank_worker.session.session import RankSession, SessionStats

Progress = Callable[[int, int], None]
# Pause of a one-process loop whose batch is empty while compiles run.
IDLE_WAIT_S = 0.002


class RankReport(msgspec.Struct, kw_only=True):
    """What one rank hands back after the loop (gathered on rank 0)."""

    rank: int
    coords: tuple[int, int, int]
    steps: int
    wall_s: float
    # Stage-0 leaders: one record per request of the replica.
    outputs: list[OutputRecord] = msgspec.field(default_factory=list)
    # Last-stage ranks: the digest of every committed mask row.
    digests: list[DigestRecord] = msgspec.field(default_factory=list)
    self_mismatches: int = 0
    # The first rows this rank masked twice differently: (request, position).
    self_mismatch_rows: list[tuple[str, int]] = msgspec.field(default_factory=list)
    stats: SessionStats | None = None
    timings: dict[str, list[float]] = msgspec.field(default_factory=dict)
    bytes_sent: int = 0
    # Control-group calls made, by "operation: kind" (coordinator.groups).
    calls: dict[str, int] = msgspec.field(default_factory=dict)


def replica_requests(
    requests: Sequence[EngineRequest], *, dp: int, replica: int, replicated: bool
) -> list[EngineRequest]:
    """The requests of one replica: all of them, or every ``dp``-th."""
    return list(requests) if replicated else list(requests[replica::dp])


def run_loop(
    session: RankSession,
    requests: Sequence[EngineRequest],
    model: LogitsSource,
    sampler: Sampler,
    speculative: SpeculativeConfig,
    *,
    per_step: int = 0,
    progress: Progress | None = None,
    on_step: Callable[[int], None] | None = None,
    on_output: Callable[[OutputRecord], None] | None = None,
    on_request_end: Callable[[str, list[tuple[int, int]]], None] | None = None,
) -> RankReport:
    """Run this rank's part of every step until the run is done.

    Parameters
    ----------
    requests:
        The whole workload; the scheduler takes its replica's share.
    per_step:
        Arrivals per step at each stage-0 leader; 0 = everything at step 0.
    progress:
        ``(finished, total)`` after each step, on stage-0 leaders.
    on_step:
        Called with the step number as each step starts, on every rank
        (resource sampling).
    on_output:
        Stage-0 leaders: each request's record as it ends (the journal).
    on_request_end:
        Last-stage ranks: ``(request, [(position, digest), ...])`` as each
        request leaves the rank (the journal).

    Raises
    ------
    PeerLostError, DivergenceError, TransportError, DeterminismError
        Infrastructure failures; the caller closes the session.
    """
    t_start = time.perf_counter()
    layout, rank = session.layout, session.rank
    c = layout.coords(rank)
    timings = Timings()
    tokenizer = session.tokenizer
    last = None
    if session.is_last_stage:
        last = ModelRunner(
            session,
            model,
            sampler,
            timings,
            # Only the leader drafts, and only with speculative decoding on.
            make_drafter=(lambda req: make_drafter(speculative, tokenizer, req))
            if session.is_leader and speculative.num_tokens > 0
            else None,
            on_request_end=on_request_end,
        )
    scheduler = None
    if session.is_leader and c.pp == 0:
        mine = replica_requests(
            requests, dp=layout.dp, replica=c.dp, replicated=layout.requests == "replicated"
        )
        scheduler = Scheduler(
            mine,
            tokenizer,
            session.leader.submit,
            max_num_seqs=session.config.scheduler.max_num_seqs,
            per_step=per_step,
            on_output=on_output,
        )
    route = layout.step_route(rank)
    link = session.link
    step = 0
    faults = session.faults
    try:
        while True:
            if faults.per_step:
                faults.on_step(step)
            if on_step is not None:
                on_step(step)
            if scheduler is not None:
                frame = _scheduler_step(session, scheduler, last, step, route, timings)
                if progress is not None:
                    progress(scheduler.num_finished, scheduler.num_requests)
            elif session.is_leader:
                frame = _follower_step(session, last, step, route, timings)
            else:
                raw = link.recv(route.frame_src, operation="batch frame", step=step)
                frame = messages.decode(raw, BatchFrame)
                for dst in route.frame_dsts:
                    link.send(dst, raw, operation="batch frame", step=step)
                if last is not None:
                    last.run(frame)
            if frame.done:
                break
            step += 1
        if last is not None:
            last.settle_tp_check()  # the last step's TP check is still in flight
    finally:
        if last is not None:
            last.close()
    digests = last.rows.digests if last is not None else None
    return RankReport(
        rank=rank,
        coords=(c.dp, c.pp, c.tp),
        steps=step + 1,
        wall_s=round(time.perf_counter() - t_start, 3),
        outputs=list(scheduler.outputs.values()) if scheduler is not None else [],
        digests=digests.records() if digests is not None else [],
        self_mismatches=len(digests.self_mismatches) if digests is not None else 0,
        self_mismatch_rows=list(digests.self_mismatches[:10]) if digests is not None else [],
        stats=session.stats,
        timings=timings.export(),
        bytes_sent=link.bytes_sent if link is not None else 0,
        calls=dict(session.runtime.calls) if session.runtime is not None else {},
    )


def _scheduler_step(session, scheduler, last, step, route, timings) -> BatchFrame:
    link = session.link
    arrivals = scheduler.arrive(step)
    if route.next_leader is not None:
        link.send(route.next_leader, messages.encode(arrivals), operation="arrivals", step=step)
    layout = session.layout
    # Replicated streams finish on the same step everywhere by construction;
    # partitioned ones vote (on the posted poison exchange, which is a
    # collective), so every replica keeps stepping until the vote that
    # settles says all of them were idle (an idle scheduler stays idle).
    votes = layout.dp > 1 and layout.requests == "partitioned"
    t0 = time.perf_counter()
    decided = session.leader.step(step, busy=not scheduler.idle if votes else None)
    timings.add("agreement", (time.perf_counter() - t0) * 1e3)
    scheduler.decided(decided.admitted, decided.failed)
    done = decided.all_idle is True if votes else scheduler.idle
    frame = scheduler.plan(step, done=done)
    if not frame.batch and not done and session.runtime is None:
        # One process with nothing to run yet: compiles are pending. Peers
        # pace multi-rank loops through their collectives; alone, don't spin.
        time.sleep(IDLE_WAIT_S)
    raw = messages.encode(frame)
    for dst in route.frame_dsts:
        link.send(dst, raw, operation="batch frame", step=step)
    if last is not None:
        results = last.run(frame)
    else:
        results = messages.decode(
            link.recv(route.last_leader, operation="step results", step=step), StepResults
        )
    scheduler.apply(results)
    if last is None:  # the last stage's leader forgot them already (same session if pp == 1)
        for res in results.results:
            if res.finish_reason is not None:
                session.leader.release(res.request_id)
    return frame


def _follower_step(session, last, step, route, timings) -> BatchFrame:
    link = session.link
    raw = link.recv(route.prev_leader, operation="arrivals", step=step)
    if route.next_leader is not None:
        link.send(route.next_leader, raw, operation="arrivals", step=step)
    arrivals = messages.decode(raw, Arrivals)
    stage = session.leader
    for sub in arrivals.requests:
        stage.submit(
            sub.request_id, json.loads(sub.spec_json), seq=sub.seq, max_tokens=sub.max_tokens
        )
    t0 = time.perf_counter()
    decided = stage.step(step)
    timings.add("agreement", (time.perf_counter() - t0) * 1e3)
    failures = tuple(
        StageFailure(o.request_id, o.code or "failed", o.message) for o in decided.stage_failed
    )
    frame = messages.decode(
        link.recv(route.frame_src, operation="batch frame", step=step), BatchFrame
    )
    for rid in frame.finished:
        stage.release(rid)
    if route.next_leader is not None:
        forward = msgspec.structs.replace(frame, failed_upstream=frame.failed_upstream + failures)
        for dst in route.frame_dsts:
            link.send(dst, messages.encode(forward), operation="batch frame", step=step)
        return frame
    for f in failures:
        last.stage_failures.setdefault(f.request_id, (f.code, f.message))
    results = last.run(frame)
    link.send(route.first_leader, messages.encode(results), operation="step results", step=step)
    return frame
