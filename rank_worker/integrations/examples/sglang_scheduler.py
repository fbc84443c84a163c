"""A miniature SGLang scheduler loop on ``SGLangGrammarManager``, one scheduler per rank.

Run it on two ranks (gloo on this machine) or on one process::

    torchrun --nproc-per-node 2 -m gramcoord.rank_worker.integrations.examples.sglang_scheduler
    torchrun --nproc-per-node 2 -m gramcoord.rank_worker.integrations.examples.sglang_scheduler \\
        --replicated
    python -m gramcoord.rank_worker.integrations.examples.sglang_scheduler

Each rank plays one SGLang scheduler process:

1. calls ``init_process_group("gloo")`` when torchrun started it (a world of
   more than one rank) and attaches its session to that world
   (``RankSession.attach``; compiles forced ``sync``); alone it uses
   ``RankSession.local``;
2. per iteration, in SGLang's order: takes its new requests (partitioned:
   every ``world``-th of ``REQUESTS``, DP-attention style; ``--replicated``:
   all of them, as TP schedulers of one stream get) and calls
   ``process_req_with_grammar``; then ``get_ready_grammar_requests`` -- every
   iteration, with or without grammar requests queued (sglang#3600); builds
   the batch, computes the deterministic ``SyntheticModel`` logits, masks
   them through the grammar objects (``allocate_vocab_mask``,
   ``fill_vocab_mask``, ``move_vocab_mask``, ``apply_vocab_mask``), samples
   greedily, ``accept_token``\\ s and checks for the end;
3. stops once every rank is idle (``all_done``) and prints one line per
   request: ``[rank R] id finish_reason iterations text-or-error``; exit 0.

The synthetic model follows each request's reference text, so outputs look
real. One schema compiles to nothing on purpose (``grammar_invalid``): with
partitioned streams it lands on the last rank, and its copy on rank 0 a few
iterations later fails at once from the shared poison, without compiling.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from gramcoord.coordinator.config import ParallelConfig
from gramcoord.rank_worker.config import GrammarConfig, SamplingConfig, TokenizerConfig
from gramcoord.rank_worker.engine.models import ModelRequest, SyntheticModel
from gramcoord.rank_worker.engine.sampler import Sampler
from gramcoord.rank_worker.grammars.tokenizer import load_tokenizer
from gramcoord.rank_worker.integrations.sglang_manager import SGLangGrammarManager
from gramcoord.rank_worker.session import RankSession, SessionConfig

# A schema xgrammar refuses although it validates (configs/workload.jsonl's
# bad/compile-error-1).
_REFUSED = json.dumps({"type": "array", "prefixItems": [True, False]})

# (id, SGLang sampling-param field, value, reference text the model follows).
REQUESTS: tuple[tuple[str, str | None, str | None, str | None], ...] = (
    (
        "person",
        "json_schema",
        json.dumps(
            {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"],
            }
        ),
        '{"name": "Ada", "age": 36}',
    ),
    ("version", "regex", r"[0-9]+\.[0-9]+\.[0-9]+", "2.13.0"),
    ("sentiment", "ebnf", 'root ::= "positive" | "negative" | "neutral"', "neutral"),
    ("greeting", None, None, "Hello there."),
    ("any-object", "json_schema", "$$ANY$$", '{"ok": true}'),
    ("refused", "json_schema", _REFUSED, None),
)
# Iteration at which rank 0 gets its own copy of the refused schema.
LATE_ITERATION = 8


@dataclass
class SamplingParams:
    """The SGLang sampling params the grammar manager reads."""

    max_new_tokens: int = 32
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None


@dataclass(eq=False)
class Req:
    """The parts of SGLang's ``Req`` this loop uses."""

    rid: str
    sampling_params: SamplingParams
    reference: str | None = None
    output_ids: list[int] = field(default_factory=list)
    grammar: Any = None
    finished_reason: str | None = None
    error: str | None = None
    iterations: tuple[int, int] = (-1, -1)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def set_finish_with_abort(self, error_msg: str) -> None:
        if self.finished_reason is None:
            self.finished_reason, self.error = "abort", error_msg


def _arrivals(rank: int, world: int, replicated: bool, max_new_tokens: int) -> dict[int, list]:
    def req(rid, name, value, reference):
        params = SamplingParams(max_new_tokens=max_new_tokens)
        if name is not None:
            setattr(params, name, value)
        return Req(rid, params, reference)

    mine = REQUESTS if replicated else REQUESTS[rank::world]
    arrivals = {0: [req(*r) for r in mine]}
    if rank == 0 and not replicated and world > 1:
        arrivals[LATE_ITERATION] = [req("refused-again", *REQUESTS[-1][1:])]
    return arrivals


class MiniScheduler:
    """SGLang's event loop, cut down to what touches grammars."""

    def __init__(self, manager: SGLangGrammarManager, arrivals: dict[int, list[Req]]) -> None:
        self.manager = manager
        tokenizer = manager.session.tokenizer
        self.tokenizer = tokenizer
        self.model = SyntheticModel(tokenizer)
        self.sampler = Sampler(SamplingConfig())
        self.stop_ids = frozenset(tokenizer.stop_ids)
        self.arrivals = arrivals
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.done: list[Req] = []
        self.started: dict[str, int] = {}

    def event_loop(self) -> list[Req]:
        it = 0
        while True:
            for req in self.arrivals.get(it, ()):  # recv_requests + handle_generate_request
                if not self.manager.process_req_with_grammar(req):
                    self.add_to_queue(it, req)
            # Every iteration, every rank: the session's step (sglang#3600).
            for req in self.manager.get_ready_grammar_requests():
                self.add_to_queue(it, req)
            self.running += self.waiting
            self.waiting = []
            if self.running:
                self.run_batch(it, list(self.running))
            else:
                time.sleep(0.002)  # compiles run meanwhile
            idle = not (any(i > it for i in self.arrivals) or self.running)
            idle = idle and not self.manager.has_waiting_grammars()
            if self.manager.all_done(idle):
                return self.done
            it += 1

    def add_to_queue(self, it: int, req: Req) -> None:
        self.started[req.rid] = it
        if req.finished():  # its grammar failed
            self.finish(it, req)
        else:
            self.waiting.append(req)

    def run_batch(self, it: int, batch: list[Req]) -> None:
        logits = self.model.logits(
            [(ModelRequest(r.rid, (), r.reference), r.output_ids) for r in batch]
        )
        # SamplingBatchInfo.update_regex_vocab_mask, then apply_logits_bias.
        grammars = [r.grammar for r in batch]
        first = next((g for g in grammars if g is not None), None)
        if first is not None:
            mask = first.allocate_vocab_mask(logits.shape[-1], len(batch), logits.device)
            for i, g in enumerate(grammars):
                if g is not None and not g.finished and not g.is_terminated():
                    g.fill_vocab_mask(mask, i)
            mask = first.move_vocab_mask(mask, logits.device)
            first.apply_vocab_mask(logits, mask)
        tokens = self.sampler.sample(logits, [(r.rid, len(r.output_ids)) for r in batch])
        # process_batch_result_decode.
        for req, token in zip(batch, tokens):
            req.output_ids.append(token)
            if req.grammar is not None:
                try:
                    req.grammar.accept_token(token)
                except ValueError as exc:
                    req.set_finish_with_abort(str(exc))
            if not req.finished():
                req.finished_reason = self.finish_reason(req, token)
            if req.grammar is not None:
                req.grammar.finished = req.finished()
            if req.finished():
                self.running.remove(req)
                self.finish(it, req)

    def finish_reason(self, req: Req, token: int) -> str | None:
        if req.grammar is not None and req.grammar.is_terminated():
            return "grammar_end"
        if token in self.stop_ids:
            return "stop"
        if len(req.output_ids) >= req.sampling_params.max_new_tokens:
            return "length"
        return None

    def finish(self, it: int, req: Req) -> None:
        req.iterations = (self.started[req.rid], it)
        self.done.append(req)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicated", action="store_true", help="every rank serves every request")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokenizer = load_tokenizer(TokenizerConfig(name="qwen2.5"))
    config = SessionConfig(
        parallel=ParallelConfig(requests="replicated" if args.replicated else "partitioned"),
        grammar=GrammarConfig(num_compile_workers=1),
    )
    if world > 1:
        dist.init_process_group("gloo")
        session = RankSession.attach(tokenizer, config)
    else:
        session = RankSession.local(tokenizer, config)
    manager = SGLangGrammarManager(session)
    try:
        arrivals = _arrivals(session.rank, world, args.replicated, args.max_new_tokens)
        done = MiniScheduler(manager, arrivals).event_loop()
    finally:
        manager.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    stops = set(tokenizer.stop_ids)
    for req in sorted(done, key=lambda r: r.rid):
        text = tokenizer.decode([t for t in req.output_ids if t not in stops])
        shown = req.error if req.error else json.dumps(text, ensure_ascii=False)
        first, last = req.iterations
        print(
            f"[rank {session.rank}] {req.rid:14} {req.finished_reason:11} "
            f"iterations {first}-{last}  {shown}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
