"""SGLang-style step loop for ``gramcoord bench step`` (written from reading
SGLang's scheduler, ``constrained/grammar_manager.py``, the xgrammar
backend, ``SamplingBatchInfo.update_regex_vocab_mask`` and the sampler;
no code copied).

Every TP rank runs a scheduler of its own and compiles and fills its own
masks; DP replicas are independent scheduler groups. Per loop iteration,
on each rank of a replica's TP group:

1. ``recv_requests``: TP rank 0 holds the arrivals and broadcasts them to
   its TP peers, pickled, every iteration (a size, then the bytes when
   there are any: SGLang's ``broadcast_pyobj``);
2. each arrival looks up the compile cache or submits a compile (one
   compile thread, the compiler settings ours uses) and waits in the
   grammar queue;
3. while the grammar queue is not empty, ``get_ready_grammar_requests``
   polls the futures for up to ``SGLANG_GRAMMAR_POLL_INTERVAL`` (5 ms),
   then the TP group agrees with ``all_gather_object`` of the (ready,
   failed) index sets: ready = intersection, failed = union;
4. the running batch is filled on a thread while the forward runs (the
   overlap scheduler's CPU/GPU overlap): a fresh bitmask, then one
   ``fill_next_token_bitmask`` per request;
5. the mask is applied to the whole batch, tokens are picked greedily and,
   because grammars are in the batch, made equal across the TP group with
   an ``all_reduce(MIN)`` (``Sampler._sync_token_ids_across_tp``); every
   rank then accepts them into its own matchers.

Strongest practice kept: the compile cache also joins in-flight compiles
of the same key (SGLang compiles a repeated key twice while the first is
running). A key is a cache hit only once the TP group agreed it ready, so
a compile that happens to finish on one rank first cannot split the
ranks' batches.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import xgrammar as xgr

from gramcoord.benchmarks._step_common import (
    BenchRequest,
    Compiler,
    Output,
    RankRun,
    RunClock,
    replica_share,
    take_token,
)
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer

# SGLANG_GRAMMAR_POLL_INTERVAL's default, in seconds.
POLL_INTERVAL_S = 0.005


def broadcast_pyobj(obj: list, *, src: int, group, is_src: bool) -> list:
    """SGLang's per-iteration request broadcast: pickled, size first."""
    size = torch.zeros(1, dtype=torch.long)
    if is_src:
        data = pickle.dumps(obj) if obj else b""
        size[0] = len(data)
        dist.broadcast(size, src=src, group=group)
        if data:
            dist.broadcast(
                torch.frombuffer(bytearray(data), dtype=torch.uint8), src=src, group=group
            )
        return obj
    dist.broadcast(size, src=src, group=group)
    n = int(size.item())
    if not n:
        return []
    buf = torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return pickle.loads(buf.numpy().tobytes())


@dataclass(eq=False)
class _Req:
    request: BenchRequest
    grammar: Future | None = None
    matcher: xgr.GrammarMatcher | None = None
    out: list[int] = field(default_factory=list)


class _Scheduler:
    """One TP rank's scheduler state for its replica."""

    def __init__(self, tokenizer: Tokenizer, group, world: int, max_num_seqs: int) -> None:
        self.group, self.world = group, world
        self.max_num_seqs = max_num_seqs
        self.vocab = tokenizer.vocab_size
        self.stop_ids = frozenset(tokenizer.stop_ids)
        self.compiler = Compiler(tokenizer)
        self.compile_pool = ThreadPoolExecutor(1, thread_name_prefix="sgl-compile")
        self.fill_pool = ThreadPoolExecutor(1, thread_name_prefix="sgl-fill")
        self.cache: dict[tuple[str, str], Future] = {}
        self.agreed: set[tuple[str, str]] = set()
        self.grammar_queue: list[_Req] = []
        self.running: list[_Req] = []
        self.outputs: dict[str, Output] = {}

    def close(self) -> None:
        self.compile_pool.shutdown(wait=True)
        self.fill_pool.shutdown(wait=True)

    def add(self, request: BenchRequest) -> None:
        key = (request.kind, request.text)
        fut = self.cache.get(key)
        if fut is None:
            fut = self.cache[key] = self.compile_pool.submit(self.compiler, request)
        req = _Req(request, grammar=fut)
        # A key counts as cached only once the TP group agreed it ready: a
        # locally finished future would let the ranks' batches diverge.
        if key in self.agreed:
            self._start(req)
        else:
            self.grammar_queue.append(req)

    def _start(self, req: _Req) -> None:
        try:
            req.matcher = xgr.GrammarMatcher(req.grammar.result())
        except Exception:  # an invalid grammar aborts its request
            self.outputs[req.request.request_id] = Output("failed", "error", [])
            return
        self.running.append(req)

    def get_ready(self) -> None:
        ready: set[int] = set()
        start = time.perf_counter()
        while time.perf_counter() - start < POLL_INTERVAL_S:
            ready.update(i for i, r in enumerate(self.grammar_queue) if r.grammar.done())
            if len(ready) == len(self.grammar_queue):
                break
            time.sleep(POLL_INTERVAL_S / 10)
        failed: set[int] = set()  # SGLang fails a grammar after 10,000 polls; none gets there
        got: list = [None] * self.world
        dist.all_gather_object(got, (ready, failed), group=self.group)
        ready = set.intersection(*(r for r, _ in got))
        failed = set.union(*(f for _, f in got))
        for i in sorted(ready - failed):
            req = self.grammar_queue[i]
            self.agreed.add((req.request.kind, req.request.text))
            self._start(req)
        for i in sorted(failed):
            self.outputs[self.grammar_queue[i].request.request_id] = Output("failed", "error", [])
        done = ready | failed
        self.grammar_queue = [r for i, r in enumerate(self.grammar_queue) if i not in done]

    def fill(self, batch: Sequence[_Req]) -> torch.Tensor:
        mask = xgr.allocate_token_bitmask(len(batch), self.vocab)
        for i, req in enumerate(batch):
            if not req.matcher.is_terminated():
                req.matcher.fill_next_token_bitmask(mask, i)
        return mask

    def accept(self, batch: Sequence[_Req], picks: Sequence[int]) -> None:
        finished = set()
        for req, token in zip(batch, picks):
            done = take_token(req, token, self.stop_ids)
            if done is not None:
                self.outputs[req.request.request_id] = done
                finished.add(req.request.request_id)
        self.running = [r for r in self.running if r.request.request_id not in finished]


def run_sglang(
    tokenizer: Tokenizer,
    requests: Sequence[BenchRequest],
    *,
    rank: int,
    dp: int,
    tp: int,
    tp_groups: Sequence,
    max_num_seqs: int,
) -> RankRun:
    """This rank's scheduler loop until its replica has finished every request."""
    replica, tp_rank = divmod(rank, tp)
    group, src = tp_groups[replica], replica * tp
    sched = _Scheduler(tokenizer, group, tp, max_num_seqs)
    clock = RunClock(record_batches=tp_rank == 0)
    model, sampler = clock.timed(tokenizer)
    inbox = replica_share(requests, dp=dp, replica=replica) if tp_rank == 0 else []
    try:
        while True:
            arrivals, inbox = inbox, []
            for request in broadcast_pyobj(arrivals, src=src, group=group, is_src=tp_rank == 0):
                sched.add(request)
            if sched.grammar_queue:
                sched.get_ready()
            if not sched.grammar_queue and not sched.running:
                break
            batch = sched.running[:max_num_seqs]
            masks = sched.fill_pool.submit(sched.fill, batch) if batch else None
            logits = model.logits([(r.request.model_request(), r.out) for r in batch])
            if masks is None:
                continue
            xgr.apply_token_bitmask_inplace(logits, masks.result())
            keys = [(r.request.request_id, len(r.out)) for r in batch]
            ids = torch.tensor(sampler.sample(logits, keys), dtype=torch.int64)
            dist.all_reduce(ids, op=dist.ReduceOp.MIN, group=group)
            sched.accept(batch, ids.tolist())
    finally:
        sched.close()
        clock.close()
    return clock.result("sglang", rank, sched.outputs if tp_rank == 0 else {})
