"""Rank bodies for TP followers: every TP rank runs its own scheduler (run_ranks)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from gramcoord.coordinator.config import DistributedConfig, ParallelConfig
from gramcoord.engine.models import ModelRequest, SyntheticModel
from gramcoord.engine.sampler import Sampler
from gramcoord.rank_worker.config import GrammarConfig, SamplingConfig, SchedulerConfig
from gramcoord.rank_worker.grammars.tokenizer import load_tokenizer
from gramcoord.rank_worker.session.session import RankSession, SessionConfig

WORKLOAD = Path(__file__).resolve().parents[2] / "configs" / "workload.jsonl"


def requests(limit: int = 6) -> list[tuple[str, dict, str | None]]:
    """Small constrained requests (with references) from the shipped workload."""
    out = []
    for line in WORKLOAD.read_text().splitlines():
        rec = json.loads(line)
        spec = rec.get("structured_outputs")
        if not spec or rec.get("expect_error") or len(json.dumps(spec)) > 600:
            continue
        ref = next(
            (json.dumps(i["data"]) for i in rec.get("instances", []) if i.get("valid")), None
        )
        out.append((rec["id"], spec, ref))
        if len(out) == limit:
            break
    out.append(("bad", {"grammar": "root ::= undefined_rule"}, None))
    return out


def scheduler_body(rank: int, world: int, mode: str, max_tokens: int = 64) -> dict:
    """One scheduler per TP rank, in lockstep; returns its log, outputs and timings."""
    tok = load_tokenizer()
    config = SessionConfig(
        parallel=ParallelConfig(tp=world, tp_followers=mode),
        distributed=DistributedConfig(step_timeout_s=30),
        grammar=GrammarConfig(compile_mode="async", compile_timeout_s=20),
        scheduler=SchedulerConfig(max_num_seqs=8),
    )
    session = RankSession.attach(tok, config, force_sync=False)
    # The same calls on both sides: the leader's roles, or the follower's.
    sched = session.leader if session.is_leader else session.follower
    masks = session.masks
    model, sampler = SyntheticModel(tok), Sampler(SamplingConfig())
    reqs = {rid: (spec, ref) for rid, spec, ref in requests()}
    log, outputs, mask_ms = [], {}, []
    try:
        for rid, (spec, _) in reqs.items():
            o = sched.submit(rid, spec)
            if o.status == "failed":
                outputs[rid] = ("failed", o.code)
        running: dict[str, list[int]] = {}
        step = 0
        while len(outputs) < len(reqs) and step < 2000:
            decided = sched.step(step)
            for o in decided.admitted:
                running[o.request_id] = []
            for o in decided.failed:
                outputs[o.request_id] = ("failed", o.code)
            batch = sorted(running)
            log.append((step, [o.request_id for o in decided.admitted], batch))
            if batch:
                t0 = time.perf_counter()
                built = masks.bitmask(batch, step=step)
                if session.is_leader:
                    masks.publish(step, built)
                mask_ms.append((time.perf_counter() - t0) * 1e3)
                rows = [(ModelRequest(r, reference=reqs[r][1]), running[r]) for r in batch]
                logits = model.logits(rows)
                _, row_digests = masks.apply(
                    logits, built.rows, batch=batch, constrained=batch, num_drafts={}
                )
                for r in batch:
                    masks.commit(r, len(running[r]), row_digests[r])
                masks.release(step)
                picks = sampler.sample(logits, [(r, len(running[r])) for r in batch])
                for r, t in zip(batch, picks):
                    running[r].append(t)
                    ended = masks.advance(r, [t])
                    if ended or len(running[r]) >= max_tokens:
                        outputs[r] = ("ok", tok.decode(running.pop(r)))
                        sched.release(r)
            else:
                time.sleep(0.005)
            step += 1
        stats = session.stats
        return {
            "log": log,
            "outputs": outputs,
            "digests": sorted(
                (d.request_id, d.position, d.digest) for d in masks.digests.records()
            ),
            "mask_ms": mask_ms,
            "compiles": stats.manager.miss if stats.manager else 0,
        }
    finally:
        session.close()
