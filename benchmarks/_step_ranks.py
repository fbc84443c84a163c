"""One rank of ``gramcoord bench step``: ours and both baselines, then the floor.

``gramcoord.launch.procs.run_ranks`` starts the dp=2 x tp=2 gloo world
once; each rank then runs every way in turn (ours, SGLang-style,
vLLM-style), a world barrier between runs, so all of them share the
processes, the warm imports and the machine's state. One untimed run of
ours comes before them; with several rounds the order rotates, so load
drift hits every way alike. The floor comes last, replaying the first
timed run of ours.

Ours: each rank attaches a ``RankSession`` to the bench's gloo world (the
external-launcher path with ``force_sync=False``, so compiles stay async
and the agreement runs every step, as under ``gramcoord run``) and runs
``engine.loop.run_loop``, the loop ``gramcoord run`` runs. The only
change: the logits source and the sampler are wrapped by a ``RunClock``.

The floor, what no implementation can skip per step, is measured in the
same processes right after the runs:

- **fill**: one xgrammar fill of the very batches ours ran. Each stage
  leader replays its replica's steps: the matchers are advanced along the
  run's own output tokens to the position each request had in each step's
  batch, and the batch is filled once with a bare ``BatchGrammarMatcher``
  on the thread count ours' builder uses at that size (one below
  ``DEFAULT_PARALLEL_THRESHOLD``);
- **memcpy**: one copy of those rows into another buffer (what a TP worker
  needs at least to hold them);
- **ping**: one gloo round trip of a 1-element tensor between the two TP
  ranks of each replica (the least a step needs to tell a worker its rows
  are there, and to hear back that the step is done).

Floor of a replica = median over steps of (fill + memcpy) + median ping.
Both replicas measure at once, as they ran.
"""

from __future__ import annotations

import datetime
import gc
import importlib
import secrets
import statistics
import time
from collections.abc import Mapping, Sequence

import msgspec
import numpy as np
import torch
import torch.distributed as dist
import xgrammar as xgr

from gramcoord.benchmarks._step_common import (
    KERNEL_HOOK,
    BenchRequest,
    Compiler,
    Output,
    RankRun,
    RunClock,
    bench_requests,
)
from gramcoord.benchmarks._step_sglang import run_sglang
from gramcoord.coordinator.config import DistributedConfig, ParallelConfig
from gramcoord.engine.loop import run_loop
from gramcoord.engine.models import SyntheticModel, vocab_index
from gramcoord.rank_worker.config import GrammarConfig, SchedulerConfig, SpeculativeConfig
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer, load_tokenizer
from gramcoord.rank_worker.masks.bitmask import DEFAULT_PARALLEL_THRESHOLD, default_fill_threads
from gramcoord.rank_worker.session.session import RankSession, SessionConfig

DP, TP = 2, 2
PING_WARMUP = 5
PING_REPEAT = 51


class FloorRun(msgspec.Struct, kw_only=True):
    rank: int
    # Stage leaders: per replayed step, ms.
    fill_ms: list[float] = msgspec.field(default_factory=list)
    memcpy_ms: list[float] = msgspec.field(default_factory=list)
    rows: list[int] = msgspec.field(default_factory=list)
    # Stage leaders: round trips to their TP peer, ms.
    ping_ms: list[float] = msgspec.field(default_factory=list)

    def floor_ms(self) -> float:
        step = [f + m for f, m in zip(self.fill_ms, self.memcpy_ms)]
        return statistics.median(step) + statistics.median(self.ping_ms)


def replay_fills(
    tokenizer: Tokenizer,
    requests: Sequence[BenchRequest],
    batches: Sequence[Sequence[tuple[str, int]]],
    outputs: Mapping[str, Output],
) -> tuple[list[float], list[float], list[int]]:
    """(fill ms, memcpy ms, rows) of every non-empty batch, replayed in order."""
    compiler = Compiler(tokenizer)
    by_id = {r.request_id: r for r in requests}
    compiled: dict[tuple[str, str], xgr.CompiledGrammar] = {}
    matchers: dict[str, xgr.GrammarMatcher] = {}
    done: dict[str, int] = {}
    width = (tokenizer.vocab_size + 31) // 32
    most = max((len(b) for b in batches), default=0)
    src = np.full((max(1, most), width), -1, dtype=np.int32)
    dst = np.empty_like(src)
    engines = {t: xgr.BatchGrammarMatcher(t) for t in {1, default_fill_threads()}}
    fills, copies, rows = [], [], []
    enabled = gc.isenabled()
    gc.disable()
    try:
        for batch in batches:
            if not batch:
                continue
            group = []
            for rid, pos in batch:
                if rid not in matchers:
                    req = by_id[rid]
                    key = (req.kind, req.text)
                    if key not in compiled:
                        compiled[key] = compiler(req)
                    matchers[rid], done[rid] = xgr.GrammarMatcher(compiled[key]), 0
                m = matchers[rid]
                for token in outputs[rid].token_ids[done[rid] : pos]:
                    if not m.accept_token(token):
                        raise RuntimeError(f"replay: {rid!r} rejects its own output at {pos}")
                done[rid] = max(done[rid], pos)
                group.append(m)
            n = len(group)
            threads = default_fill_threads() if n >= DEFAULT_PARALLEL_THRESHOLD else 1
            t0 = time.perf_counter()
            engines[threads].batch_fill_next_token_bitmask(group, src[:n], None)
            t1 = time.perf_counter()
            np.copyto(dst[:n], src[:n])
            t2 = time.perf_counter()
            fills.append((t1 - t0) * 1e3)
            copies.append((t2 - t1) * 1e3)
            rows.append(n)
    finally:
        if enabled:
            gc.enable()
    return fills, copies, rows


def ping_ms(*, rank: int, peer: int, group, leader: bool) -> list[float]:
    """Round trips of a 1-element gloo tensor; only the leader's are kept."""
    t = torch.zeros(1, dtype=torch.int64)
    out = []
    for i in range(PING_WARMUP + PING_REPEAT):
        t0 = time.perf_counter()
        if leader:
            dist.send(t, dst=peer, group=group)
            dist.recv(t, src=peer, group=group)
        else:
            dist.recv(t, src=peer, group=group)
            dist.send(t, dst=peer, group=group)
        if leader and i >= PING_WARMUP:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def measure_floor(
    tokenizer: Tokenizer,
    requests: Sequence[BenchRequest],
    *,
    rank: int,
    tp: int,
    tp_groups: Sequence,
    batches: Sequence[Sequence[tuple[str, int]]],
    outputs: Mapping[str, Output],
) -> FloorRun:
    """This rank's part of the floor (every rank of the world calls it)."""
    replica, tp_rank = divmod(rank, tp)
    run = FloorRun(rank=rank)
    if tp_rank == 0:
        run.fill_ms, run.memcpy_ms, run.rows = replay_fills(tokenizer, requests, batches, outputs)
    dist.barrier()
    leader = replica * tp
    if tp_rank in (0, 1):
        peer = leader + 1 if tp_rank == 0 else leader
        got = ping_ms(rank=rank, peer=peer, group=tp_groups[replica], leader=tp_rank == 0)
        if tp_rank == 0:
            run.ping_ms = got
    return run


class WorldOptions(msgspec.Struct, frozen=True, kw_only=True):
    workload: str
    limit: int
    copies: int
    max_tokens: int
    max_num_seqs: int
    rounds: int
    step_timeout_s: float
    # "ours", "sglang", "vllm"; the first must be ours.
    ways: tuple[str, ...] = ("ours", "sglang", "vllm")
    # Names the runs' shared-memory segments and sockets ("" = a fresh id per run).
    run_id: str = ""


class WorldResult(msgspec.Struct, kw_only=True):
    runs: list[RankRun]
    floor: FloorRun


def run_ours(tokenizer, requests, opts: WorldOptions) -> RankRun:
    """This rank's part of one run of ours: dp=2 x tp=2 as ``configs/local.yaml``,
    jump-forward off (neither baseline has it)."""
    config = SessionConfig(
        parallel=ParallelConfig(dp=DP, tp=TP, requests="partitioned"),
        distributed=DistributedConfig(step_timeout_s=opts.step_timeout_s),
        grammar=GrammarConfig(compile_mode="async", compile_timeout_s=60, jump_forward=False),
        scheduler=SchedulerConfig(max_num_seqs=opts.max_num_seqs),
    )
    run_id = opts.run_id or f"bstep{secrets.token_hex(3)}"
    session = RankSession.attach(tokenizer, config, run_id=run_id, force_sync=False)
    clock = RunClock(record_batches=session.is_leader)
    ok = False
    try:
        engine_requests = [r.engine_request() for r in requests]
        model, sampler = clock.timed(tokenizer)
        report = run_loop(session, engine_requests, model, sampler, SpeculativeConfig())
        ok = True
    finally:
        session.close(drain=ok)
        clock.close()
    outputs = {o.id: Output(o.status, o.finish_reason, list(o.token_ids)) for o in report.outputs}
    return clock.result("ours", session.rank, outputs, timings=report.timings)


def _run(way: str, tokenizer, requests, opts: WorldOptions, rank: int, tp_groups) -> RankRun:
    if way == "ours":
        return run_ours(tokenizer, requests, opts)
    kw = dict(rank=rank, dp=DP, tp=TP, tp_groups=tp_groups, max_num_seqs=opts.max_num_seqs)
    if way == "sglang":
        return run_sglang(tokenizer, requests, **kw)
    if way == "vllm":
        from gramcoord.benchmarks._step_vllm import run_vllm

        return run_vllm(tokenizer, requests, timeout_s=opts.step_timeout_s, **kw)
    raise ValueError(f"unknown way {way!r}")


def child(rank: int, world: int, opts: WorldOptions) -> WorldResult:
    """Entry of every rank (``run_ranks`` made the gloo world)."""
    assert world == DP * TP, world
    tokenizer = load_tokenizer()
    requests = bench_requests(
        opts.workload, limit=opts.limit, copies=opts.copies, max_tokens=opts.max_tokens
    )
    KERNEL_HOOK.install()
    if "vllm" in opts.ways:
        # vLLM's queue is imported before any run, so that every way runs
        # in a process that has vLLM loaded.
        importlib.import_module("gramcoord.benchmarks._step_vllm")
    # Lazy per-process tables, built before anything is timed.
    vocab_index(tokenizer)
    SyntheticModel(tokenizer).logits([])
    timeout = datetime.timedelta(seconds=opts.step_timeout_s)
    tp_groups = [
        dist.new_group(list(range(d * TP, (d + 1) * TP)), backend="gloo", timeout=timeout)
        for d in range(DP)
    ]
    # One untimed run first: the first run in a process pays for page
    # faults on fresh logits buffers and lazy set-up, which would bias
    # whichever way happened to go first.
    dist.barrier()
    _run(opts.ways[0], tokenizer, requests, opts, rank, tp_groups)
    runs: list[RankRun] = []
    for r in range(opts.rounds):
        shift = r % len(opts.ways)
        for way in opts.ways[shift:] + opts.ways[:shift]:
            dist.barrier()
            runs.append(_run(way, tokenizer, requests, opts, rank, tp_groups))
    first = next(run for run in runs if run.way == opts.ways[0])
    dist.barrier()
    floor = measure_floor(
        tokenizer,
        requests,
        rank=rank,
        tp=TP,
        tp_groups=tp_groups,
        batches=first.batches,
        outputs=first.outputs,
    )
    dist.barrier()
    for g in tp_groups:
        dist.destroy_process_group(g)
    return WorldResult(runs=runs, floor=floor)
