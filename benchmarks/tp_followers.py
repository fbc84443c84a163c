"""TP followers that read the leader's rows vs followers that fill their own.

With ``parallel.tp_followers`` every TP rank runs its own scheduler (SGLang,
vLLM's external launcher) and follows its leader's decision each step. Two
ways to get the step's mask rows on a follower:

- ``read``: the leader compiles and fills; the follower waits for the rows
  in shared memory. Its critical path is the leader's fill plus the
  transport; it compiles nothing.
- ``fill``: every rank compiles every grammar and fills its own rows, as
  SGLang's TP ranks do (sglang#13809). No transport, but the compile and
  fill work is repeated on every rank.

One run, 2 ranks (tp=2), the same requests in both modes. Rows, per mode:

- ``follower_rows_*``: median ms per step for the follower to hold its rows;
  the note adds the compile time each follower spent in total.

``ratio`` is fill / read (above 1: reading is cheaper). On this 2-core
machine both ranks share the cores, so a filling follower competes with its
leader for CPU; on a GPU node each rank has cores of its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from gramcoord.benchmarks._contract import WORKLOAD, BenchRecord
from gramcoord.launch.procs import run_ranks


def _requests(limit: int) -> list[tuple[str, dict, str | None]]:
    out = []
    for line in WORKLOAD.read_text().splitlines():
        rec = json.loads(line)
        spec = rec.get("structured_outputs")
        if not spec or rec.get("expect_error"):
            continue
        ref = next(
            (json.dumps(i["data"]) for i in rec.get("instances", []) if i.get("valid")), None
        )
        out.append((rec["id"], spec, ref))
    return out[:limit]


def _child(rank: int, world: int, mode: str, limit: int, max_tokens: int) -> dict:
    from gramcoord.coordinator.config import DistributedConfig, ParallelConfig
    from gramcoord.engine.models import ModelRequest, SyntheticModel
    from gramcoord.engine.sampler import Sampler
    from gramcoord.rank_worker.config import GrammarConfig, SamplingConfig, SchedulerConfig
    from gramcoord.rank_worker.grammars.tokenizer import load_tokenizer
    from gramcoord.rank_worker.session.session import RankSession, SessionConfig

    tok = load_tokenizer()
    reqs = {rid: (spec, ref) for rid, spec, ref in _requests(limit)}
    config = SessionConfig(
        parallel=ParallelConfig(tp=world, tp_followers=mode),
        distributed=DistributedConfig(step_timeout_s=60),
        grammar=GrammarConfig(compile_mode="async", compile_timeout_s=30),
        scheduler=SchedulerConfig(max_num_seqs=len(reqs)),
    )
    session = RankSession.attach(tok, config, force_sync=False)
    sched = session.leader if session.is_leader else session.follower
    masks = session.masks
    model, sampler = SyntheticModel(tok), Sampler(SamplingConfig())
    rows_ms: list[float] = []
    compile_ms = 0.0
    try:
        done: set[str] = set()
        for rid, (spec, _) in reqs.items():
            if sched.submit(rid, spec).status == "failed":
                done.add(rid)
        running: dict[str, list[int]] = {}
        step = 0
        while len(done) < len(reqs):
            decided = sched.step(step)
            for o in decided.admitted:
                running[o.request_id] = []
                compile_ms += o.compile_ms
            done.update(o.request_id for o in decided.failed)
            batch = sorted(running)
            if batch:
                t0 = time.perf_counter()
                rows = masks.bitmask(batch, step=step)
                if session.is_leader:
                    masks.publish(step, rows)
                rows_ms.append((time.perf_counter() - t0) * 1e3)
                logits = model.logits(
                    [(ModelRequest(r, reference=reqs[r][1]), running[r]) for r in batch]
                )
                masks.apply(logits, rows.rows, batch=batch, constrained=batch, num_drafts={})
                masks.release(step)
                for r, t in zip(
                    batch, sampler.sample(logits, [(r, len(running[r])) for r in batch])
                ):
                    running[r].append(t)
                    if masks.advance(r, [t]) or len(running[r]) >= max_tokens:
                        running.pop(r)
                        sched.release(r)
                        done.add(r)
            else:
                time.sleep(0.002)
            step += 1
        return {"rows_ms": rows_ms, "compile_ms": compile_ms, "steps": step}
    finally:
        session.close()


def run(args: list[str]) -> list[BenchRecord]:
    p = argparse.ArgumentParser(prog="gramcoord bench tp_followers")
    p.add_argument("--requests", type=int, default=32, help="constrained requests per run")
    p.add_argument("--max-tokens", type=int, default=64)
    opts = p.parse_args(args)
    got = {}
    for mode in ("read", "fill"):
        results = run_ranks(
            "gramcoord.benchmarks.tp_followers:_child",
            2,
            args=(mode, opts.requests, opts.max_tokens),
            timeout=600,
        )
        got[mode] = results[1].value  # the follower
    read, fill = got["read"], got["fill"]
    note = (
        f"median ms per step for the follower to hold its rows ({read['steps']} / "
        f"{fill['steps']} steps); a filling follower also compiled for "
        f"{fill['compile_ms']:.0f} ms in total, a reading one for {read['compile_ms']:.0f} ms; "
        f"tp=2, {opts.requests} requests, 2 cores shared"
    )
    return [
        BenchRecord.compare(
            "follower_rows_read",
            "follower_rows_fill",
            statistics.median(read["rows_ms"]),
            statistics.median(fill["rows_ms"]),
            note=note,
        )
    ]
