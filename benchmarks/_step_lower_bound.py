"""The physical floor of one step's coordination, for ``gramcoord bench step``.

What no implementation can skip per step, measured in the same processes
right after the runs:

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

import gc
import statistics
import time
from collections.abc import Mapping, Sequence

import msgspec
import numpy as np
import torch
import torch.distributed as dist
import xgrammar as xgr

from gramcoord.benchmarks._step_common import BenchRequest, Compiler, Output
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer
from gramcoord.rank_worker.masks.bitmask import DEFAULT_PARALLEL_THRESHOLD, default_fill_threads

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
