"""Merge the ranks' reports into ``outputs.jsonl``, ``digests.jsonl`` and ``summary.json``.

Rank 0 gathers every rank's ``RankReport`` at the end of a run and calls
``merge``. What each summary figure means is documented in
docs/running.md ("Run summary"). The comparison of mask digests across ranks lives here:
every row a request's grammar masked at an output position is digested by
each rank that applied it; all of them must agree, and in replicated mode
every replica must produce the same outputs.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from gramcoord.engine.requests import EngineRequest, OutputRecord
from gramcoord.engine.timings import Percentiles, percentiles
from gramcoord.launch.journal import PriorRun
from gramcoord.launch.validity import JsonChecker

if TYPE_CHECKING:  # the step loop imports torch; `gramcoord config` must not
    from gramcoord.engine.loop import RankReport
    from gramcoord.rank_worker.session.digest import DigestRecord


class Mismatch(msgspec.Struct, frozen=True):
    """A determinism failure: what differs, where, and on which ranks."""

    what: str
    request_id: str
    position: int
    ranks: tuple[int, ...]


class Determinism(msgspec.Struct, kw_only=True):
    ranks_compared: int = 0
    # Steps whose sampled tokens and mask rows were cross-checked across TP
    # ranks during the run (summed over the last stages).
    steps_compared: int = 0
    # (request, position) mask rows compared across two or more ranks.
    rows_compared: int = 0
    mismatches: int = 0
    first: list[Mismatch] = msgspec.field(default_factory=list)


class Summary(msgspec.Struct, kw_only=True):
    requests: dict[str, Any]
    finish_reasons: dict[str, int]
    tokens: dict[str, int]
    latency_ms: dict[str, Percentiles]
    cache: dict[str, int]
    json_valid: dict[str, int]
    # Outputs of grammars that do not enforce all of their schema, validated
    # at the end: how many, and how many broke the schema (failed with
    # schema_breach, never ok).
    end_checks: dict[str, int] = msgspec.field(default_factory=dict)
    # Finished outputs of json / json_object requests parsed as JSON: how
    # many, and how many were not JSON (failed with output_not_json, never ok).
    json_checks: dict[str, int] = msgspec.field(default_factory=dict)
    # Resumed and restarted runs: requests carried over from earlier
    # attempts' journals, how many attempts came before, and journal lines
    # dropped as torn or damaged (their requests ran again); rank 0 adds
    # this attempt's number, the elastic restarts, and the requests this
    # attempt ran (every request not carried over).
    journal: dict[str, int] = msgspec.field(default_factory=dict)
    # Control frames the TP readers dropped (malformed, stale) and the
    # writers garbled on purpose (faults.corrupt_frames_every).
    transport: dict[str, int]
    determinism: Determinism
    steps: int
    # Seconds on rank 0 from its start (tokenizer, session, rendezvous,
    # loop, gather); ``gramcoord run``'s headline adds the launch itself.
    wall_s: float
    config: dict[str, Any]
    # Seconds in the step loop (the slowest rank's).
    loop_s: float = 0.0
    # Control-group calls per step, by role ("stage-0 leader", "later stage
    # leader", "TP worker") and "operation: kind" (kind: "blocking", waited
    # for at once; "posted", settled steps later; "send"), averaged over the
    # ranks of the role: where a step can wait.
    calls_per_step: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)
    # Filled by ``gramcoord run`` once every rank exited (launch/resources.py):
    # RSS at warm-up and at the end, threads left, leaked /dev/shm entries
    # and leftover processes.
    resources: dict[str, Any] = msgspec.field(default_factory=dict)


def _compare_digests(
    reports: Sequence[RankReport], det: Determinism, prior: dict[int, list[DigestRecord]]
) -> None:
    seen: dict[tuple[str, int], dict[int, int]] = defaultdict(dict)
    for rank, rows in prior.items():  # earlier attempts of a resumed run
        for d in rows:
            seen[(d.request_id, d.position)][rank] = d.digest
    for rep in reports:
        for d in rep.digests:
            seen[(d.request_id, d.position)][rep.rank] = d.digest
        if rep.self_mismatches:
            det.mismatches += rep.self_mismatches
            for rid, pos in rep.self_mismatch_rows:
                if len(det.first) < 10:
                    det.first.append(
                        Mismatch("row masked twice differently", rid, pos, (rep.rank,))
                    )
    appliers = [r for r in reports if r.digests or (r.stats and r.stats.rows_applied)]
    det.ranks_compared = len(appliers)
    # Each TP group of a last stage cross-checks every step once.
    groups = Counter((r.coords[0], r.coords[1]) for r in appliers)
    det.steps_compared = sum(
        r.steps for r in appliers if r.coords[2] == 0 and groups[(r.coords[0], r.coords[1])] > 1
    )
    for (rid, pos), by_rank in sorted(seen.items()):
        if len(by_rank) < 2:
            continue
        det.rows_compared += 1
        values = Counter(by_rank.values())
        if len(values) > 1:
            common = values.most_common(1)[0][0]
            odd = tuple(sorted(r for r, v in by_rank.items() if v != common))
            det.mismatches += 1
            if len(det.first) < 10:
                det.first.append(Mismatch("mask digest", rid, pos, odd))


def _compare_replicas(origins: Sequence[RankReport], det: Determinism) -> None:
    base = {o.id: o for o in origins[0].outputs}
    for rep in origins[1:]:
        for o in rep.outputs:
            ref = base.get(o.id)
            if ref is None or (ref.token_ids, ref.status) != (o.token_ids, o.status):
                det.mismatches += 1
                if len(det.first) < 10:
                    det.first.append(Mismatch("replica output", o.id, -1, (rep.rank,)))


def _samples(reports: Sequence[RankReport], name: str) -> list[float]:
    return [x for r in reports for x in r.timings.get(name, ())]


def role_of(coords: tuple[int, int, int]) -> str:
    """The step-loop role of a rank at ``(dp, pp, tp)``."""
    if coords[2] > 0:
        return "TP worker"
    return "stage-0 leader" if coords[1] == 0 else "later stage leader"


def calls_per_step(reports: Sequence[RankReport]) -> dict[str, dict[str, float]]:
    """Each role's control-group calls per step, averaged over its ranks."""
    by_role: dict[str, list[RankReport]] = defaultdict(list)
    for r in reports:
        if r.calls:
            by_role[role_of(r.coords)].append(r)
    out: dict[str, dict[str, float]] = {}
    for role, reps in sorted(by_role.items()):
        total: Counter[str] = Counter()
        for r in reps:
            for name, n in r.calls.items():
                total[name] += n / max(r.steps, 1)
        out[role] = {k: round(v / len(reps), 3) for k, v in sorted(total.items())}
    return out


def merge(
    reports: Sequence[RankReport],
    requests: Sequence[EngineRequest],
    *,
    replicated: bool,
    wall_s: float,
    config: dict[str, Any],
    prior: PriorRun | None = None,
) -> tuple[list[OutputRecord], Summary]:
    """Outputs in workload order, and the run's summary.

    ``prior`` is what earlier attempts of a resumed or restarted run
    journaled: their outputs and digests count as this run's.
    """
    prior = prior or PriorRun()
    origins = [r for r in reports if r.coords[1] == 0 and r.coords[2] == 0]
    det = Determinism()
    _compare_digests(reports, det, prior.digests)
    if replicated and len(origins) > 1:
        _compare_replicas(origins, det)
    by_id: dict[str, OutputRecord] = {rid: line.record for rid, line in prior.outputs.items()}
    for rep in origins if not replicated else origins[:1]:
        for o in rep.outputs:
            by_id.setdefault(o.id, o)
    outputs = [by_id[r.request_id] for r in requests if r.request_id in by_id]
    checker = JsonChecker()
    specs = {r.request_id: r.spec for r in requests}
    for o in outputs:
        if o.status == "ok":
            checker.check(specs.get(o.id), o.text)
    failed = [o for o in outputs if o.status == "failed"]
    stats = [r.stats.manager for r in origins if r.stats and r.stats.manager]
    compile_ms = [o.compile_ms for o in outputs if o.cache == "miss" and o.compile_ms > 0]
    summary = Summary(
        requests={
            "total": len(outputs),
            "ok": len(outputs) - len(failed),
            "failed": len(failed),
            "by_error": dict(Counter(o.error.code for o in failed if o.error)),
        },
        finish_reasons=dict(Counter(o.finish_reason for o in outputs)),
        tokens={
            "generated": sum(len(o.token_ids) for o in outputs),
            "model_steps": sum(o.model_steps for o in outputs),
            "jump_forward_tokens": sum(o.jump_forward_tokens for o in outputs),
        },
        latency_ms={
            "agreement": percentiles(_samples(origins, "agreement")),
            "mask_build": percentiles(_samples(reports, "mask_build")),
            "transport": percentiles(_samples(reports, "transport")),
            "apply": percentiles(_samples(reports, "apply")),
            "forward": percentiles(_samples(reports, "forward")),
            "compile": percentiles(compile_ms),
        },
        cache={
            "hits": sum(s.hit for s in stats),
            "misses": sum(s.miss for s in stats),
            "poisoned_hits": sum(s.poisoned for s in stats),
            "joined": sum(s.joined for s in stats),
            "warm": sum(s.warm for s in stats),
        },
        json_valid=checker.counts(),
        end_checks={
            "checked": sum(o.end_check is not None for o in outputs),
            "failed": sum(o.end_check == "failed" for o in outputs),
        },
        json_checks={
            "checked": sum(o.json_check is not None for o in outputs),
            "failed": sum(o.json_check == "failed" for o in outputs),
        },
        transport={
            "dropped": sum(r.stats.transport_dropped for r in reports if r.stats),
            "corrupted": sum(r.stats.transport_corrupted for r in reports if r.stats),
        },
        determinism=det,
        steps=max((r.steps for r in reports), default=0),
        wall_s=round(wall_s, 3),
        config=config,
        loop_s=max((r.wall_s for r in reports), default=0.0),
        calls_per_step=calls_per_step(reports),
        journal={
            "carried": len(prior.outputs),
            "attempts_before": prior.attempts,
            "dropped_lines": prior.dropped,
        },
    )
    return outputs, summary


def digests_by_request(
    reports: Sequence[RankReport], prior: PriorRun | None = None
) -> dict[str, list[tuple[int, int]]]:
    """One rank's view of every committed row (the lowest rank that has it)."""
    rows: dict[tuple[str, int], int] = {}
    by_rank: dict[int, list[DigestRecord]] = defaultdict(list)
    for rank, records in (prior.digests if prior else {}).items():
        by_rank[rank].extend(records)
    for rep in reports:
        by_rank[rep.rank].extend(rep.digests)
    for rank in sorted(by_rank):
        for d in by_rank[rank]:
            rows.setdefault((d.request_id, d.position), d.digest)
    out: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for (rid, pos), digest in sorted(rows.items()):
        out[rid].append((pos, digest))
    return dict(out)


def write_run(
    out_dir: Path,
    outputs: Sequence[OutputRecord],
    summary: Summary,
    digests: dict[str, list[tuple[int, int]]],
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    enc = msgspec.json.Encoder()
    with open(out_dir / "outputs.jsonl", "wb") as f:
        for o in outputs:
            f.write(enc.encode(o) + b"\n")
    with open(out_dir / "digests.jsonl", "w") as f:
        for rid, rows in digests.items():
            f.write(json.dumps({"id": rid, "rows": rows}) + "\n")
    write_summary(out_dir, summary)


def write_summary(out_dir: Path, summary: Summary) -> None:
    data = msgspec.json.encode(summary)
    (out_dir / "summary.json").write_bytes(msgspec.json.format(data, indent=2))
