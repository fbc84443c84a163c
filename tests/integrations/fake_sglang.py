"""A stand-in for SGLang's scheduler loop that drives ``SGLangGrammarManager``.

One iteration has the shape of SGLang's ``Scheduler.event_loop_normal``:

1. ``recv_requests``: stage 0 takes this iteration's arrivals and forwards
   them down the pipeline stages in the same iteration, as SGLang does over
   its PP group; later stages receive them;
2. ``process_input_requests``: ``process_req_with_grammar`` for each; a
   request that need not wait goes to the waiting queue;
3. ``get_next_batch_to_run``: ``get_ready_grammar_requests`` every iteration
   on every rank (``guard=True`` restores SGLang's ``if
   has_waiting_grammars()`` guard, the sglang#3600 shape), then the batch:
   running requests, first come first served;
4. ``run_batch``: stage 0 hands its batch down (a stage whose own batch
   differs raises, where SGLang fails on shapes: sglang#28424); the last
   stage computes ``SyntheticModel`` logits, masks them through the grammar
   objects as ``SamplingBatchInfo.update_regex_vocab_mask`` and
   ``apply_logits_bias`` do, samples, and sends the tokens back to stage 0;
5. ``process_batch_result``: every stage appends the tokens, calls
   ``accept_token`` (a ``ValueError`` aborts the request), checks for the
   end and sets ``grammar.finished``.

The loop ends when every replica's stage 0 is idle (``all_done``); stage 0
tells later stages in its next forward message. The host's own messages
between stages go over the session's byte link.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gramcoord.launch.workload import REPO_ROOT, WorkloadRecord, read_workload
from gramcoord.rank_worker.config import SamplingConfig
from gramcoord.rank_worker.engine.models import ModelRequest, SyntheticModel
from gramcoord.rank_worker.engine.sampler import Sampler
from gramcoord.rank_worker.integrations.sglang_grammar import ANY_JSON
from gramcoord.rank_worker.integrations.sglang_manager import SGLangGrammarManager

WORKLOAD = REPO_ROOT / "configs" / "workload.jsonl"
MAX_NEW_TOKENS = 48
# Pause of an iteration that ran no batch: compiles run on the pool meanwhile.
IDLE_SLEEP_S = 0.002


@dataclass
class SamplingParams:
    """SGLang's field names (only those the grammar manager reads)."""

    max_new_tokens: int = MAX_NEW_TOKENS
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None


@dataclass(eq=False)
class Req:
    """The parts of SGLang's ``Req`` the loop and the grammar manager use."""

    rid: str
    sampling_params: SamplingParams
    # The synthetic model follows it.
    reference: str | None = None
    output_ids: list[int] = field(default_factory=list)
    grammar: Any = None
    finished_reason: str | None = None
    error: str | None = None

    def finished(self) -> bool:
        return self.finished_reason is not None

    def set_finish_with_abort(self, error_msg: str) -> None:
        if self.finished_reason is None:
            self.finished_reason, self.error = "abort", error_msg


def load_records(ids: Sequence[str]) -> dict[str, WorkloadRecord]:
    """Records of the shipped workload by id (each must exist)."""
    wanted = set(ids)
    found = {r.id: r for r in read_workload(WORKLOAD) if r.id in wanted}
    missing = wanted - found.keys()
    assert not missing, f"not in {WORKLOAD}: {sorted(missing)}"
    return found


def _choice_ebnf(options: Sequence[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(o) for o in options)


def to_req(record: WorkloadRecord, rid: str | None = None) -> Req:
    """A workload record as an SGLang request (vLLM spec -> SGLang sampling params)."""
    spec = record.spec or {}
    params = SamplingParams(max_new_tokens=min(record.max_tokens or MAX_NEW_TOKENS, MAX_NEW_TOKENS))
    if "json" in spec:
        schema = spec["json"]
        params.json_schema = schema if isinstance(schema, str) else json.dumps(schema)
    elif "regex" in spec:
        params.regex = spec["regex"]
    elif "grammar" in spec:
        params.ebnf = spec["grammar"]
    elif "choice" in spec:
        params.ebnf = _choice_ebnf(spec["choice"])
    elif spec.get("json_object"):
        params.json_schema = ANY_JSON
    elif "structural_tag" in spec:
        params.structural_tag = json.dumps(spec["structural_tag"])
    return Req(rid or record.id, params, reference=record.reference)


# -- messages between pipeline stages (the host's own, not gramcoord's) --------


class WireReq(msgspec.Struct, frozen=True, array_like=True):
    rid: str
    params: str
    reference: str | None


class Inbox(msgspec.Struct, frozen=True, tag=True):
    """Stage 0 -> later stages, at the top of each iteration."""

    iteration: int
    requests: tuple[WireReq, ...] = ()
    done: bool = False


class BatchIds(msgspec.Struct, frozen=True, tag=True):
    """Stage 0 -> later stages: the batch (stands in for the activations)."""

    iteration: int
    rids: tuple[str, ...] = ()


class Tokens(msgspec.Struct, frozen=True, tag=True):
    """Last stage -> stage 0: the tokens sampled for the batch."""

    iteration: int
    tokens: tuple[int, ...] = ()


_encode = msgspec.msgpack.Encoder().encode
_decoders = {t: msgspec.msgpack.Decoder(t) for t in (Inbox, BatchIds, Tokens)}


class BatchMismatch(RuntimeError):
    """Two pipeline stages scheduled different batches in one iteration."""


# -- what the loop reports ---------------------------------------------------------


@dataclass
class Iteration:
    """What one rank did in one iteration."""

    # Whether a grammar request was queued when the iteration's get-ready
    # point came, and whether the get-ready call ran.
    waiting_grammars: bool
    called: bool
    # Requests that became runnable from the grammar queue.
    ready: tuple[str, ...]
    # Requests that failed (at arrival or out of the grammar queue), sorted.
    failed: tuple[str, ...]
    batch: tuple[str, ...]


@dataclass
class Output:
    rid: str
    finish_reason: str
    token_ids: list[int]
    text: str
    error: str | None
    # Iteration at which the request entered the waiting queue (None: failed).
    admitted_at: int | None
    # Iteration at which it left finished.
    finished_at: int


@dataclass
class Report:
    rank: int
    coords: tuple[int, int, int]
    iterations: list[Iteration]
    outputs: dict[str, Output]
    # Compile calls on this rank, by spec text (filled in by the rank bodies).
    compiles: dict[str, int] = field(default_factory=dict)


class FakeScheduler:
    """SGLang's event loop around ``SGLangGrammarManager``; see the module docstring.

    Parameters
    ----------
    manager:
        This scheduler's grammar manager.
    arrivals:
        Stage 0 only: iteration -> requests arriving then.
    max_running:
        Most requests in a batch.
    guard:
        Call ``get_ready_grammar_requests`` only when a grammar request is
        queued, as SGLang does (the sglang#3600 bug).
    """

    def __init__(
        self,
        manager: SGLangGrammarManager,
        arrivals: dict[int, list[Req]] | None = None,
        *,
        max_running: int = 8,
        guard: bool = False,
    ) -> None:
        session = manager.session
        self.manager = manager
        self.session = session
        self.tokenizer = session.tokenizer
        self.model = SyntheticModel(self.tokenizer)
        self.sampler = Sampler(SamplingConfig())
        self.stop_ids = frozenset(self.tokenizer.stop_ids)
        self.arrivals = arrivals or {}
        self.max_running = max_running
        self.guard = guard
        layout = session.layout
        c = layout.coords(session.rank)
        self.coords = c
        self.prev = layout.leader(c.dp, c.pp - 1) if c.pp > 0 else None
        self.next = layout.leader(c.dp, c.pp + 1) if c.pp < layout.pp - 1 else None
        self.last = layout.leader(c.dp, layout.pp - 1)
        self.link = session.link
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.admitted_at: dict[str, int] = {}
        self.outputs: dict[str, Output] = {}
        self.iterations: list[Iteration] = []
        self._failed: list[str] = []
        self.stop = False

    # -- the event loop --------------------------------------------------------

    def event_loop(self) -> Report:
        it = 0
        while True:
            reqs, stop = self.recv_requests(it)
            if stop:
                break
            self.process_input_requests(it, reqs)
            batch = self.get_next_batch_to_run(it)
            self.run_batch(it, batch)
            if self.prev is None:
                self.stop = self.manager.all_done(self.idle(it))
            if not batch:
                time.sleep(IDLE_SLEEP_S)
            it += 1
        return Report(
            rank=self.session.rank,
            coords=tuple(self.coords),
            iterations=self.iterations,
            outputs=self.outputs,
        )

    def idle(self, it: int) -> bool:
        more = any(i > it for i in self.arrivals)
        return not (more or self.manager.has_waiting_grammars() or self.waiting or self.running)

    def recv_requests(self, it: int) -> tuple[list[Req], bool]:
        if self.prev is None:
            reqs = [] if self.stop else list(self.arrivals.get(it, ()))
            if self.next is not None:
                wire = tuple(
                    WireReq(r.rid, json.dumps(msgspec.to_builtins(r.sampling_params)), r.reference)
                    for r in reqs
                )
                self._send(self.next, Inbox(it, wire, self.stop), it)
            return reqs, self.stop
        inbox = self._recv(self.prev, Inbox, it)
        if self.next is not None:
            self._send(self.next, inbox, it)
        reqs = [
            Req(w.rid, SamplingParams(**json.loads(w.params)), reference=w.reference)
            for w in inbox.requests
        ]
        return reqs, inbox.done

    def process_input_requests(self, it: int, reqs: list[Req]) -> None:
        self._failed = []
        for req in reqs:
            if not self.manager.process_req_with_grammar(req):
                self._add_request_to_queue(it, req)

    def get_next_batch_to_run(self, it: int) -> list[Req]:
        waiting_grammars = self.manager.has_waiting_grammars()
        called = not self.guard or waiting_grammars
        ready: list[str] = []
        if called:
            for req in self.manager.get_ready_grammar_requests():
                if not req.finished():
                    ready.append(req.rid)
                self._add_request_to_queue(it, req)
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.pop(0))
        batch = list(self.running)
        self.iterations.append(
            Iteration(
                waiting_grammars,
                called,
                tuple(ready),
                tuple(sorted(self._failed)),
                tuple(r.rid for r in batch),
            )
        )
        return batch

    def _add_request_to_queue(self, it: int, req: Req) -> None:
        if req.finished():  # failed or aborted: it ends without running
            self._failed.append(req.rid)
            self._record(it, req)
            return
        self.admitted_at[req.rid] = it
        self.waiting.append(req)

    # -- the forward pass ----------------------------------------------------------

    def run_batch(self, it: int, batch: list[Req]) -> None:
        rids = tuple(r.rid for r in batch)
        if self.prev is not None:
            upstream = self._recv(self.prev, BatchIds, it).rids
            if upstream != rids:
                raise BatchMismatch(
                    f"[rank {self.session.rank}] iteration {it}: stage 0 runs {list(upstream)}, "
                    f"this stage scheduled {list(rids)}"
                )
        if self.next is not None:
            self._send(self.next, BatchIds(it, rids), it)
        if self.next is None:
            tokens = self.sample(batch)
            for stage in range(self.coords.pp):
                self._send(
                    self.session.layout.leader(self.coords.dp, stage), Tokens(it, tuple(tokens)), it
                )
        else:
            tokens = list(self._recv(self.last, Tokens, it).tokens)
        self.process_batch_result(it, batch, tokens)

    def sample(self, batch: list[Req]) -> list[int]:
        if not batch:
            return []
        logits = self.model.logits(
            [(ModelRequest(r.rid, (), r.reference), r.output_ids) for r in batch]
        )
        # SamplingBatchInfo.update_regex_vocab_mask, then apply_logits_bias.
        grammars = [r.grammar for r in batch]
        first = next((g for g in grammars if g is not None), None)
        if first is not None:
            mask = first.allocate_vocab_mask(
                vocab_size=logits.shape[-1], batch_size=len(batch), device=logits.device
            )
            for i, g in enumerate(grammars):
                if g is not None and not g.finished and not g.is_terminated():
                    g.fill_vocab_mask(mask, i)
            mask = first.move_vocab_mask(mask, logits.device)
            first.apply_vocab_mask(logits, mask)
        return self.sampler.sample(logits, [(r.rid, len(r.output_ids)) for r in batch])

    def process_batch_result(self, it: int, batch: list[Req], tokens: list[int]) -> None:
        for req, token in zip(batch, tokens, strict=True):
            req.output_ids.append(token)
            if req.grammar is not None:
                try:
                    req.grammar.accept_token(token)
                except ValueError as exc:
                    req.set_finish_with_abort(str(exc))
            self._check_finished(req, token)
            if req.grammar is not None:
                req.grammar.finished = req.finished()
            if req.finished():
                self.running.remove(req)
                self._record(it, req)

    def _check_finished(self, req: Req, token: int) -> None:
        if req.finished():
            return
        if req.grammar is not None and req.grammar.is_terminated():
            req.finished_reason = "grammar_end"
        elif token in self.stop_ids:
            req.finished_reason = "stop"
        elif len(req.output_ids) >= req.sampling_params.max_new_tokens:
            req.finished_reason = "length"

    def _record(self, it: int, req: Req) -> None:
        text = self.tokenizer.decode([t for t in req.output_ids if t not in self.stop_ids])
        self.outputs[req.rid] = Output(
            rid=req.rid,
            finish_reason=req.finished_reason,
            token_ids=list(req.output_ids),
            text=text,
            error=req.error,
            admitted_at=self.admitted_at.get(req.rid),
            finished_at=it,
        )

    # -- the host's messages ---------------------------------------------------------

    def _send(self, dst: int, message: Any, it: int) -> None:
        self.link.send(dst, _encode(message), operation=type(message).__name__, step=it)

    def _recv(self, src: int, kind: type, it: int) -> Any:
        return _decoders[kind].decode(self.link.recv(src, operation=kind.__name__, step=it))
