"""vLLM-style step loop for ``gramcoord bench step`` (written from reading
vLLM V1's ``EngineCore.step``, ``StructuredOutputManager``, the scheduler's
``get_grammar_bitmask`` and the GPU model runner's
``apply_grammar_bitmask``; no code copied).

Each DP replica is an independent engine. Its TP rank 0 plays the engine
core (scheduler plus structured-output manager) and worker 0; TP rank 1 is
worker 1. Per step:

1. ``schedule``: requests waiting for their grammar (compiled on the
   manager's pool, the compiler settings ours uses) join the running batch
   once their future is done; nothing is agreed with anyone;
2. ``execute_model``: the scheduler output (new requests, the batch,
   finished ids) is broadcast to the workers through vLLM's own
   shared-memory broadcast queue (``MessageQueue`` of
   ``vllm.distributed.device_communicators.shm_broadcast``, built as vLLM's
   executor builds it); every worker runs the forward;
3. meanwhile the engine core fills the bitmask (``grammar_bitmask``: one
   preallocated buffer, sequential fills up to 128 requests, chunks of 16
   on a pool of ``min(cpu // 2, 8)`` threads above) and returns it as numpy;
4. ``sample_tokens``: the grammar output (structured request ids and the
   bitmask) is broadcast the same way; every worker lays the rows out in
   batch order, applies them and samples greedily;
5. ``update_from_output``: the engine core accepts the tokens into the
   grammars and finishes requests.

Worker 0 lives in the engine core's process here, so its output needs no
trip back (vLLM sends it through a response queue): in vLLM's favour.
Needs vLLM: ``gramcoord bench step`` runs this way only where it is importable.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import xgrammar as xgr
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

from gramcoord.benchmarks._step_common import (
    BenchRequest,
    Compiler,
    Output,
    RankRun,
    RunClock,
    replica_share,
    take_token,
)
from gramcoord.benchmarks._vllm_common import vllm_queue
from gramcoord.engine.models import ModelRequest
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer

# StructuredOutputManager's parallel-fill threshold and chunk size.
PARALLEL_FILL_ABOVE = 128
FILL_CHUNK = 16


@dataclass
class SchedulerOutput:
    step: int
    # (request id, reference) of requests scheduled for the first time.
    new: list[tuple[str, str | None]]
    # The batch, in order.
    scheduled: list[str]
    finished: list[str]


@dataclass
class GrammarOutput:
    structured_ids: list[str]
    bitmask: np.ndarray


@dataclass(eq=False)
class _Req:
    request: BenchRequest
    grammar: Future
    matcher: xgr.GrammarMatcher | None = None
    out: list[int] = field(default_factory=list)


class _Manager:
    """The engine core's structured-output manager and scheduler state."""

    def __init__(self, tokenizer: Tokenizer, max_num_seqs: int) -> None:
        self.stop_ids = frozenset(tokenizer.stop_ids)
        self.compiler = Compiler(tokenizer)
        cpus = multiprocessing.cpu_count()
        self.compile_pool = ThreadPoolExecutor(max(1, (cpus + 1) // 2))
        self.fill_pool = (
            ThreadPoolExecutor(max(1, min(cpus // 2, 8)))
            if max_num_seqs > PARALLEL_FILL_ABOVE
            else None
        )
        self.bitmask = xgr.allocate_token_bitmask(max_num_seqs, tokenizer.vocab_size)
        self.max_num_seqs = max_num_seqs
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.finished: list[str] = []
        self.outputs: dict[str, Output] = {}

    def close(self) -> None:
        self.compile_pool.shutdown(wait=True)
        if self.fill_pool is not None:
            self.fill_pool.shutdown(wait=True)

    def add(self, request: BenchRequest) -> None:
        self.waiting.append(_Req(request, self.compile_pool.submit(self.compiler, request)))

    def schedule(self, step: int) -> SchedulerOutput:
        new = []
        still = []
        for req in self.waiting:
            if not req.grammar.done() or len(self.running) >= self.max_num_seqs:
                still.append(req)
                continue
            try:
                req.matcher = xgr.GrammarMatcher(req.grammar.result())
            except Exception:  # a grammar that fails to compile aborts its request
                self.outputs[req.request.request_id] = Output("failed", "error", [])
                self.finished.append(req.request.request_id)
                continue
            self.running.append(req)
            r = req.request
            new.append((r.request_id, r.reference))
        self.waiting = still
        finished, self.finished = self.finished, []
        ids = [r.request.request_id for r in self.running]
        return SchedulerOutput(step, new, ids, finished)

    def _fill(self, batch: Sequence[tuple[xgr.GrammarMatcher, int]]) -> None:
        for matcher, i in batch:
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(self.bitmask, i)
            else:
                self.bitmask[i].fill_(-1)

    def grammar_bitmask(self) -> GrammarOutput | None:
        batch = [(r.matcher, i) for i, r in enumerate(self.running)]
        if not batch:
            return None
        if len(batch) > PARALLEL_FILL_ABOVE and self.fill_pool is not None:
            chunks = [batch[i : i + FILL_CHUNK] for i in range(0, len(batch), FILL_CHUNK)]
            for f in [self.fill_pool.submit(self._fill, c) for c in chunks]:
                f.result()
        else:
            self._fill(batch)
        ids = [r.request.request_id for r in self.running]
        return GrammarOutput(ids, self.bitmask[: len(batch)].numpy())

    def update_from_output(self, picks: Sequence[int]) -> None:
        keep = []
        for req, token in zip(self.running, picks):
            done = take_token(req, token, self.stop_ids)
            if done is None:
                keep.append(req)
            else:
                self.outputs[req.request.request_id] = done
                self.finished.append(req.request.request_id)
        self.running = keep


class _Worker:
    """A worker's persistent batch: its own copy of every running request's tokens."""

    def __init__(self, model) -> None:
        self.model = model
        self.reqs: dict[str, tuple[ModelRequest, list[int]]] = {}

    def update(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished:
            self.reqs.pop(rid, None)
        for rid, reference in sched.new:
            self.reqs[rid] = (ModelRequest(rid, (), reference), [])

    def rows(self, ids: Sequence[str]):
        return [self.reqs[r] for r in ids]


def _apply(logits: torch.Tensor, ids: Sequence[str], grammar: GrammarOutput) -> None:
    """The model runner's side: rows into batch order, then mask in place."""
    order = {rid: i for i, rid in enumerate(ids)}
    sorted_mask = np.full((len(ids), grammar.bitmask.shape[1]), -1, dtype=np.int32)
    out_indices = []
    for j, rid in enumerate(grammar.structured_ids):
        sorted_mask[order[rid]] = grammar.bitmask[j]
        out_indices.append(order[rid])
    indices = None if len(out_indices) == len(ids) else out_indices
    xgr.apply_token_bitmask_inplace(logits, torch.from_numpy(sorted_mask), indices=indices)


def _sample(sampler, logits, worker: _Worker, ids: Sequence[str]) -> list[int]:
    return sampler.sample(logits, [(r, len(worker.reqs[r][1])) for r in ids])


def run_vllm(
    tokenizer: Tokenizer,
    requests: Sequence[BenchRequest],
    *,
    rank: int,
    dp: int,
    tp: int,
    tp_groups: Sequence,
    max_num_seqs: int,
    timeout_s: float,
) -> RankRun:
    """This rank's engine-core or worker loop until its replica is done."""
    replica, tp_rank = divmod(rank, tp)
    group, src = tp_groups[replica], replica * tp
    clock = RunClock(record_batches=tp_rank == 0)
    model, sampler = clock.timed(tokenizer)
    worker = _Worker(model)
    manager = None
    try:
        with contextlib.ExitStack() as stack:
            # Set-up, not the hot path: the queue's handle goes to the peers pickled.
            box: list = [None]
            if tp_rank == 0:
                queue = stack.enter_context(vllm_queue(tp - 1))
                box = [queue.export_handle()]
            dist.broadcast_object_list(box, src=src, group=group)
            if tp_rank != 0:
                queue = MessageQueue.create_from_handle(box[0], tp_rank - 1)
            queue.wait_until_ready()
            if tp_rank == 0:
                manager = _Manager(tokenizer, max_num_seqs)
                for request in replica_share(requests, dp=dp, replica=replica):
                    manager.add(request)
                _engine_core(manager, queue, worker, sampler)
            else:
                _worker_loop(queue, worker, sampler, timeout_s)
            dist.barrier(group=group)  # no one drops the queue under a reader
    finally:
        if manager is not None:
            manager.close()
        clock.close()
    return clock.result("vllm", rank, manager.outputs if manager is not None else {})


def _engine_core(manager: _Manager, queue, worker: _Worker, sampler) -> None:
    # The fill runs while the forward does (vLLM: execute_model returns at
    # once and get_grammar_bitmask runs in the meantime).
    overlap = ThreadPoolExecutor(1, thread_name_prefix="vllm-grammar-bitmask")
    try:
        step = 0
        while manager.waiting or manager.running:
            sched = manager.schedule(step)
            queue.enqueue(("execute_model", sched))
            worker.update(sched)
            ids = sched.scheduled
            fill = overlap.submit(manager.grammar_bitmask)
            logits = worker.model.logits(worker.rows(ids))
            grammar = fill.result()
            if ids:
                queue.enqueue(("sample_tokens", grammar))
                _apply(logits, ids, grammar)
                picks = _sample(sampler, logits, worker, ids)
                for rid, token in zip(ids, picks):
                    worker.reqs[rid][1].append(token)
                manager.update_from_output(picks)
            step += 1
        queue.enqueue(("shutdown", SchedulerOutput(step, [], [], [])))
    finally:
        overlap.shutdown(wait=True)


def _worker_loop(queue, worker: _Worker, sampler, timeout_s: float) -> None:
    while True:
        kind, sched = queue.dequeue(timeout=timeout_s)
        worker.update(sched)
        if kind == "shutdown":
            return
        ids = sched.scheduled
        logits = worker.model.logits(worker.rows(ids))
        if not ids:
            continue
        kind, grammar = queue.dequeue(timeout=timeout_s)
        assert kind == "sample_tokens", kind
        _apply(logits, ids, grammar)
        for rid, token in zip(ids, _sample(sampler, logits, worker, ids)):
            worker.reqs[rid][1].append(token)
