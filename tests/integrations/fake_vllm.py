"""A fake vLLM V1 engine core around ``integrations.vllm_backend`` (not a test module).

It replays vLLM's step order (``EngineCore.step`` of v0.11.1+) with the
adapter in the places vLLM calls its ``StructuredOutputManager``:

1. ``Scheduler.schedule()``: ``manager.update(step)`` first, on every call
   (the one collective), then requests whose grammar slot resolved are
   promoted (admitted) or finished (failed), then the batch is planned:
   running requests first come first served, each with its draft tokens;
2. ``ModelRunner.execute_model(scheduler_output)`` starts the forward on a
   thread (``SyntheticModel`` logits, text-keyed, following the request's
   reference);
3. meanwhile ``Scheduler.get_grammar_bitmask``: ``manager.grammar_bitmask``
   for the scheduled structured requests, drafts included;
4. ``ModelRunner.sample_tokens(grammar_output)``: the worker lays the
   compact rows onto its own batch order (a persistent batch whose freed
   slots are reused, so its order differs from the scheduler's) with
   ``plan_rows`` and ``LogitsMasker``, samples, and verifies drafts;
5. ``Scheduler.update_from_output``: ``grammar.accept_tokens``; a rejected
   token, a stop token, a terminated grammar or ``max_tokens`` finishes the
   request (``manager.finish_request``);
6. ``take_draft_token_ids`` -> ``Scheduler.update_draft_token_ids``:
   ``grammar.validate_tokens`` trims the drafts.

``dp_rank`` runs one external-launcher-style rank (each rank its own
scheduler over the same request stream, ``parallel.requests: replicated``),
``pp_rank`` one stage of a dp=1 pp=2 chain (stage 0 schedules; stage 1
follows the decision, builds the masks, samples and accepts). Both are
``run_procs`` targets and return plain values for the parent to compare.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from gramcoord.coordinator.config import DistributedConfig, ParallelConfig
from gramcoord.launch.workload import parse_record, read_workload
from gramcoord.rank_worker.config import (
    GrammarConfig,
    SamplingConfig,
    SchedulerConfig,
    SpeculativeConfig,
    TokenizerConfig,
)
from gramcoord.rank_worker.engine.drafter import make_drafter
from gramcoord.rank_worker.engine.last_stage import accepted_tokens
from gramcoord.rank_worker.engine.models import ModelRequest, SyntheticModel
from gramcoord.rank_worker.engine.sampler import Sampler
from gramcoord.rank_worker.errors import SpecError
from gramcoord.rank_worker.grammars.spec import GrammarSpec, validate_spec
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer, load_tokenizer
from gramcoord.rank_worker.integrations.vllm_backend import (
    StructuredOutputRequest,
)
from gramcoord.rank_worker.integrations.vllm_manager import GramcoordStructuredOutputManager
from gramcoord.rank_worker.masks.logits_apply import LogitsMasker, plan_rows
from gramcoord.rank_worker.session.session import RankSession, SessionConfig

WORKLOAD = Path(__file__).resolve().parents[2] / "configs" / "workload.jsonl"
# Pause of a step whose batch is empty (compiles pending): do not spin.
IDLE_S = 0.005

WAITING = "WAITING"
WAITING_FOR_GRAMMAR = "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"
RUNNING = "RUNNING"
FINISHED = "FINISHED"


# -- requests ---------------------------------------------------------------------


@dataclass(eq=False)
class FakeRequest:
    """The fields of vLLM's ``Request`` the scheduler and the adapter use."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    reference: str | None
    params: dict | None
    structured_output_request: StructuredOutputRequest | None
    status: str = WAITING
    output_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error_code: str | None = None
    finished_step: int = -1

    @property
    def use_structured_output(self) -> bool:
        return self.structured_output_request is not None


def make_requests(
    tokenizer: Tokenizer,
    ids: Sequence[str],
    *,
    extra: Sequence[dict] = (),
    max_tokens: int = 48,
) -> list[FakeRequest]:
    """Requests for workload ids (in that order), then ``extra`` workload records."""
    by_id = {r.id: r for r in read_workload(WORKLOAD)}
    records = [by_id[i] for i in ids]
    for i, rec in enumerate(extra):
        records.append(parse_record(10_000 + i, json.dumps(rec)))
    out = []
    for rec in records:
        params = rec.spec if rec.constrained else None
        out.append(
            FakeRequest(
                request_id=rec.id,
                prompt_token_ids=tokenizer.encode(rec.prompt) if rec.prompt else [],
                max_tokens=min(rec.max_tokens or max_tokens, max_tokens),
                reference=rec.reference,
                params=params,
                structured_output_request=StructuredOutputRequest.from_params(params),
            )
        )
    return out


# -- messages (vLLM's SchedulerOutput / GrammarOutput / ModelRunnerOutput) ----------


class NewRequestData(msgspec.Struct, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    reference: str | None
    max_tokens: int


class SchedulerOutput(msgspec.Struct):
    step: int
    # Scheduled requests in scheduling order -> tokens to compute.
    num_scheduled_tokens: dict[str, int]
    scheduled_spec_decode_tokens: dict[str, list[int]]
    scheduled_new_reqs: list[NewRequestData]
    finished_req_ids: list[str]


class GrammarOutput(msgspec.Struct):
    structured_output_request_ids: list[str]
    grammar_bitmask: Any  # numpy int32, compact rows


class ModelRunnerOutput(msgspec.Struct):
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Pipeline stage 1 accepted the tokens itself: (code, message) per
    # rejected request, and the requests whose grammar terminated.
    errors: dict[str, tuple[str, str]] = msgspec.field(default_factory=dict)
    terminated: list[str] = msgspec.field(default_factory=list)


# -- compile skew -------------------------------------------------------------------


class SkewedCompile:
    """The session's compile function after a delay chosen per spec (and per rank).

    ``stop`` cuts pending delays short at shutdown; a compile cut short
    fails instead of compiling.
    """

    def __init__(self, inner: Callable[[GrammarSpec], Any], delay: Callable[[str], float]):
        self.inner = inner
        self.delay = delay
        self.stop = threading.Event()
        # Canonical spec text -> time.monotonic() when its compile returned.
        self.done_at: dict[str, float] = {}

    def __call__(self, spec: GrammarSpec) -> Any:
        if self.stop.wait(self.delay(spec.text)):
            raise RuntimeError("compile cut short at shutdown")
        try:
            return self.inner(spec)
        finally:
            self.done_at[spec.text] = time.monotonic()


def skew_compiles(session: RankSession, delay: Callable[[str], float]) -> SkewedCompile:
    """Wrap this rank's compile function (``CompileService._compile``)."""
    service = session.manager.service
    skewed = SkewedCompile(service._compile, delay)
    service._compile = skewed
    return skewed


def delay_table(table: dict[str, float], default: float) -> Callable[[str], float]:
    """Delay of the first ``table`` marker found in the spec text, else ``default``."""

    def delay(text: str) -> float:
        for marker, seconds in table.items():
            if marker in text:
                return seconds
        return default

    return delay


# -- scheduler ----------------------------------------------------------------------


@dataclass
class StepRecord:
    step: int
    admitted: list[str]
    failed: list[tuple[str, str]]
    batch: list[tuple[str, tuple[int, ...]]]


class FakeScheduler:
    """vLLM's ``Scheduler``: waiting / running queues, grammar readiness, outputs.

    Parameters
    ----------
    manager:
        The adapter's manager (``manager.update`` runs in every ``schedule``).
    stop_ids:
        Stop tokens.
    max_num_seqs:
        Batch size limit.
    grammar_remote:
        Pipeline stage 0: a later stage accepts the tokens and reports
        rejections (``ModelRunnerOutput.errors``); this scheduler never
        touches grammar state.
    """

    def __init__(
        self,
        manager: GramcoordStructuredOutputManager,
        *,
        stop_ids: Sequence[int],
        max_num_seqs: int,
        grammar_remote: bool = False,
    ) -> None:
        self.manager = manager
        self.stop_ids = frozenset(stop_ids)
        self.max_num_seqs = max_num_seqs
        self.grammar_remote = grammar_remote
        self.requests: dict[str, FakeRequest] = {}
        self.waiting: list[FakeRequest] = []
        self.running: OrderedDict[str, FakeRequest] = OrderedDict()
        self.finished: dict[str, FakeRequest] = {}
        self._finished_since: list[str] = []
        self._started: set[str] = set()
        self.step = 0
        self.log: list[StepRecord] = []
        # time.monotonic() right after each step's update (index = step - 1).
        self.decided_at: list[float] = []
        # Fault injection: (step, request id) whose sampled tokens are not
        # passed to accept_tokens (as a scheduler that loses an output would).
        self.drop_accept: set[tuple[int, str]] = set()

    # vLLM: Scheduler.add_request (the engine core called grammar_init already
    # in vLLM's Processor; here the scheduler does it, on arrival).
    def add_request(self, request: FakeRequest, *, seq: int | None = None):
        self.requests[request.request_id] = request
        outcome = self.manager.grammar_init(request, seq=seq)
        request.status = WAITING_FOR_GRAMMAR if request.use_structured_output else WAITING
        self.waiting.append(request)
        return outcome

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        self.step += 1
        # The one collective, unconditionally, before anything reads readiness.
        self.manager.update(self.step)
        self.decided_at.append(time.monotonic())
        admitted, failed = [], []
        still_waiting = []
        for req in self.waiting:
            if req.status == WAITING_FOR_GRAMMAR:
                sor = req.structured_output_request
                if not sor.is_grammar_ready:
                    still_waiting.append(req)
                    continue
                grammar = sor.grammar
                if isinstance(grammar, Exception):
                    failed.append((req.request_id, grammar.code))
                    self._finish(req, "error", grammar.code)
                    continue
                req.status = WAITING
                admitted.append(req.request_id)
            if len(self.running) < self.max_num_seqs:
                req.status = RUNNING
                self.running[req.request_id] = req
            else:
                still_waiting.append(req)
        self.waiting = still_waiting
        num_tokens: dict[str, int] = {}
        spec: dict[str, list[int]] = {}
        new: list[NewRequestData] = []
        for rid, req in self.running.items():
            num_tokens[rid] = 1 + len(req.spec_token_ids)
            if req.spec_token_ids:
                spec[rid] = list(req.spec_token_ids)
            if rid not in self._started:
                self._started.add(rid)
                new.append(NewRequestData(rid, req.prompt_token_ids, req.reference, req.max_tokens))
        finished, self._finished_since = self._finished_since, []
        self.log.append(
            StepRecord(
                self.step,
                admitted,
                failed,
                [(rid, tuple(spec.get(rid, ()))) for rid in num_tokens],
            )
        )
        return SchedulerOutput(self.step, num_tokens, spec, new, finished)

    def get_grammar_bitmask(self, so: SchedulerOutput) -> GrammarOutput | None:
        ids = [r for r in so.num_scheduled_tokens if self.requests[r].use_structured_output]
        if not ids:
            return None
        rows = self.manager.grammar_bitmask(self.requests, ids, so.scheduled_spec_decode_tokens)
        return GrammarOutput(ids, rows)

    def update_from_output(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        terminated = set(out.terminated)
        for rid, tokens in zip(out.req_ids, out.sampled_token_ids):
            req = self.running.get(rid)
            if req is None:
                continue
            req.spec_token_ids = []
            error = out.errors.get(rid)
            ended = rid in terminated
            if (
                error is None
                and tokens
                and not self.grammar_remote
                and self.manager.should_advance(req)
                and (so.step, rid) not in self.drop_accept
            ):
                grammar = req.structured_output_request.grammar
                if grammar.accept_tokens(rid, tokens):
                    ended = grammar.is_terminated()
                else:
                    error = (grammar.error.code.name, grammar.error.message)
            if error is not None:
                self._finish(req, "error", error[0])
                continue
            req.output_token_ids.extend(tokens)
            if ended:
                self._finish(req, "grammar_end")
            elif tokens and tokens[-1] in self.stop_ids:
                self._finish(req, "stop")
            elif len(req.output_token_ids) >= req.max_tokens:
                self._finish(req, "length")

    def update_draft_token_ids(self, drafts: dict[str, list[int]]) -> None:
        for rid, proposal in drafts.items():
            req = self.running.get(rid)
            if req is None:
                continue
            if req.use_structured_output and not self.grammar_remote:
                proposal = req.structured_output_request.grammar.validate_tokens(proposal)
            req.spec_token_ids = list(proposal)

    def _finish(self, req: FakeRequest, reason: str, code: str | None = None) -> None:
        req.status = FINISHED
        req.finish_reason = reason
        req.error_code = code
        req.finished_step = self.step
        self.running.pop(req.request_id, None)
        self.finished[req.request_id] = req
        self._finished_since.append(req.request_id)
        if req.use_structured_output:
            self.manager.finish_request(req.request_id)


# -- model runner -------------------------------------------------------------------


@dataclass(eq=False)
class _View:
    request: ModelRequest
    max_tokens: int
    out: list[int] = field(default_factory=list)
    drafter: Any = None


class FakeModelRunner:
    """vLLM's GPU model runner on CPU: persistent batch, forward, apply, sample.

    Parameters
    ----------
    tokenizer:
        Vocabulary of the logits.
    k:
        Speculative tokens per request (0: no drafts).
    max_num_seqs:
        Batch size limit (sizes the aligned mask buffer).
    """

    def __init__(self, tokenizer: Tokenizer, *, k: int, max_num_seqs: int) -> None:
        self.tokenizer = tokenizer
        self.k = k
        self.model = SyntheticModel(tokenizer)
        self.sampler = Sampler(SamplingConfig())
        self.stop_ids = frozenset(tokenizer.stop_ids)
        self.speculative = SpeculativeConfig(num_tokens=k, drafter="replay")
        self.masker = LogitsMasker((tokenizer.vocab_size + 31) // 32, max_num_seqs * (1 + k))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fake-forward")
        self.views: dict[str, _View] = {}
        self.slots: list[str | None] = []
        self._batch: list[str] = []
        self._drafts: dict[str, list[int]] = {}
        self._step = 0
        self._forward: Future | None = None
        self._proposals: dict[str, list[int]] = {}
        # (step, digest of the applied compact rows and their request ids)
        self.mask_digests: list[tuple[int, str]] = []

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def execute_model(self, so: SchedulerOutput) -> Future | None:
        """Update the persistent batch and start the forward (``non_block=True``)."""
        for rid in so.finished_req_ids:
            self.views.pop(rid, None)
            if rid in self.slots:
                self.slots[self.slots.index(rid)] = None
        for nr in so.scheduled_new_reqs:
            view = _View(
                ModelRequest(nr.request_id, tuple(nr.prompt_token_ids), nr.reference),
                nr.max_tokens,
            )
            view.drafter = make_drafter(self.speculative, self.tokenizer, view.request)
            self.views[nr.request_id] = view
            free = self.slots.index(None) if None in self.slots else len(self.slots)
            if free == len(self.slots):
                self.slots.append(None)
            self.slots[free] = nr.request_id
        self._step = so.step
        self._batch = [r for r in self.slots if r is not None and r in so.num_scheduled_tokens]
        self._drafts = {r: list(so.scheduled_spec_decode_tokens.get(r, ())) for r in self._batch}
        if not self._batch:
            self._forward = None
            return None
        rows = [
            (self.views[r].request, self.views[r].out + self._drafts[r][:i])
            for r in self._batch
            for i in range(1 + len(self._drafts[r]))
        ]
        self._forward = self._pool.submit(self.model.logits, rows)
        return self._forward

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Wait for the logits, apply the grammar rows, sample, verify drafts."""
        logits = self._forward.result()
        batch, drafts = self._batch, self._drafts
        if grammar_output is not None:
            self._apply(logits, grammar_output)
        keys = [(r, len(self.views[r].out) + i) for r in batch for i in range(1 + len(drafts[r]))]
        picks = self.sampler.sample(logits, keys)
        sampled: list[list[int]] = []
        self._proposals = {}
        offset = 0
        for r in batch:
            view = self.views[r]
            n = 1 + len(drafts[r])
            room = view.max_tokens - len(view.out)
            acc = accepted_tokens(picks[offset : offset + n], drafts[r], self.stop_ids, room)
            offset += n
            view.out.extend(acc)
            sampled.append(acc)
            left = min(self.k, view.max_tokens - len(view.out) - 1)
            if view.drafter is not None and left > 0 and not (acc and acc[-1] in self.stop_ids):
                self._proposals[r] = view.drafter.propose(view.out, left)[:left]
        return ModelRunnerOutput(list(batch), sampled)

    def _apply(self, logits, go: GrammarOutput) -> None:
        """vLLM's ``apply_grammar_bitmask``: compact rows onto this batch's logit rows."""
        num_drafts = {r: len(d) for r, d in self._drafts.items()}
        plan = plan_rows(self._batch, go.structured_output_request_ids, num_drafts, 1 + self.k)
        rows = go.grammar_bitmask
        if rows.shape[0] != len(plan.dst):
            raise AssertionError(f"{rows.shape[0]} bitmask rows for {len(plan.dst)} logit rows")
        # Compact layout: the rows are exactly plan.src's rows, in order.
        plan = plan._replace(src=np.arange(len(plan.dst), dtype=np.int64))
        self.masker.apply(logits, rows, plan)
        h = hashlib.blake2b(np.ascontiguousarray(rows).data, digest_size=8)
        h.update("|".join(go.structured_output_request_ids).encode())
        self.mask_digests.append((self._step, h.hexdigest()))

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        out, self._proposals = self._proposals, {}
        return out


# -- engine core ----------------------------------------------------------------------


class FakeEngineCore:
    """vLLM's ``EngineCore.step`` order over a scheduler and a model runner."""

    def __init__(self, scheduler: FakeScheduler, runner: FakeModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner

    def step(self) -> bool:
        """One engine step; ``False`` when nothing was scheduled."""
        so = self.scheduler.schedule()
        future = self.runner.execute_model(so)  # non_block=True
        if future is None:
            return False
        grammar_output = self.scheduler.get_grammar_bitmask(so)  # while the forward runs
        output = self.runner.sample_tokens(grammar_output)
        self.scheduler.update_from_output(so, output)
        drafts = self.runner.take_draft_token_ids()  # EngineCore.post_step
        if drafts:
            self.scheduler.update_draft_token_ids(drafts)
        return True


def run_engine(
    core: FakeEngineCore,
    requests: Sequence[FakeRequest],
    *,
    per_step: int = 2,
    max_steps: int = 3000,
) -> int:
    """Feed ``per_step`` arrivals before each step until every request finished."""
    queue = list(requests)
    steps = 0
    while True:
        for req in queue[:per_step]:
            core.scheduler.add_request(req)
        queue = queue[per_step:]
        if not queue and not core.scheduler.has_unfinished_requests():
            return steps
        if not core.step():
            time.sleep(IDLE_S)
        steps += 1
        if steps >= max_steps:
            raise AssertionError(f"the engine did not finish in {max_steps} steps")


def outputs_of(scheduler: FakeScheduler) -> dict[str, dict]:
    """Per finished request: tokens, reason, error code, the step it finished at."""
    return {
        rid: dict(
            tokens=list(r.output_token_ids),
            reason=r.finish_reason,
            code=r.error_code,
            step=r.finished_step,
        )
        for rid, r in sorted(scheduler.finished.items())
    }


def build_core(
    session: RankSession, tokenizer: Tokenizer, *, k: int, max_num_seqs: int
) -> FakeEngineCore:
    manager = GramcoordStructuredOutputManager(session)
    scheduler = FakeScheduler(manager, stop_ids=tokenizer.stop_ids, max_num_seqs=max_num_seqs)
    return FakeEngineCore(scheduler, FakeModelRunner(tokenizer, k=k, max_num_seqs=max_num_seqs))


def session_config(
    *,
    dp: int = 1,
    pp: int = 1,
    k: int = 0,
    max_num_seqs: int = 16,
    requests: str = "replicated",
    **grammar: Any,
) -> SessionConfig:
    return SessionConfig(
        parallel=ParallelConfig(dp=dp, pp=pp, requests=requests),
        distributed=DistributedConfig(step_timeout_s=30.0, init_timeout_s=60.0),
        grammar=GrammarConfig(num_compile_workers=1, **grammar),
        speculative=SpeculativeConfig(num_tokens=k, drafter="replay"),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
    )


def run_local(
    tokenizer: Tokenizer,
    ids: Sequence[str],
    *,
    extra: Sequence[dict] = (),
    k: int = 0,
    max_tokens: int = 48,
) -> dict[str, dict]:
    """The one-process reference: sync compile, no skew."""
    session = RankSession.local(tokenizer, session_config(k=k, compile_mode="sync"))
    core = build_core(session, tokenizer, k=k, max_num_seqs=16)
    try:
        run_engine(core, make_requests(tokenizer, ids, extra=extra, max_tokens=max_tokens))
    finally:
        core.runner.close()
        core.scheduler.manager.clear_backend()
    return outputs_of(core.scheduler)


# -- rank bodies (run_procs targets) ----------------------------------------------------


def _log(scheduler: FakeScheduler) -> list[tuple]:
    return [(r.step, r.admitted, r.failed, r.batch) for r in scheduler.log]


def dp_rank(rank: int, world: int, job: dict) -> dict:
    """One external-launcher rank: its own scheduler, the replicated stream."""
    tokenizer = load_tokenizer(TokenizerConfig(name="qwen2.5"))
    config = session_config(
        dp=world,
        k=job["k"],
        compile_mode="async",
        compile_timeout_s=job["compile_timeout_s"],
    )
    session = RankSession.start(tokenizer, config, rank=rank)
    skewed = skew_compiles(session, delay_table(job["delays"][rank], job["base_delay"][rank]))
    core = build_core(session, tokenizer, k=job["k"], max_num_seqs=16)
    requests = make_requests(
        tokenizer, job["ids"], extra=job.get("extra", ()), max_tokens=job["max_tokens"]
    )
    t0 = time.perf_counter()
    try:
        steps = run_engine(core, requests, per_step=job["per_step"])
    finally:
        skewed.stop.set()
        core.runner.close()
        core.scheduler.manager.clear_backend()
    return dict(
        rank=rank,
        steps=steps,
        wall_s=time.perf_counter() - t0,
        log=_log(core.scheduler),
        outputs=outputs_of(core.scheduler),
        digests=core.runner.mask_digests,
        ready_steps=local_ready_steps(session, core.scheduler, requests, skewed),
    )


def local_ready_steps(
    session: RankSession, scheduler: FakeScheduler, requests: Sequence[FakeRequest], skewed
) -> dict[str, int]:
    """Per request compiled here: the first step whose decision came after its compile.

    A decision that admits a request at step ``s`` read this rank's status
    after the compile returned, so its ready step is at most ``s``; the
    admission step minus the ready step is how long the agreement held the
    request back for a slower rank.
    """
    out = {}
    for req in requests:
        if req.params is None:
            continue
        try:
            text = validate_spec(req.params, session.config.grammar, vocab=session.tokenizer.name)
        except SpecError:
            continue
        done = skewed.done_at.get(text.text)
        if done is not None:
            out[req.request_id] = 1 + bisect.bisect_left(scheduler.decided_at, done)
    return out


class PPArrivals(msgspec.Struct):
    step: int
    done: bool
    # (request id, seq, spec JSON or "" for unconstrained)
    requests: list[tuple[str, int, str]]


def pp_rank(rank: int, world: int, job: dict) -> dict:
    """One stage of a dp=1 pp=2 chain (rank 0: scheduler, rank 1: masks and sampling)."""
    assert world == 2
    tokenizer = load_tokenizer(TokenizerConfig(name="qwen2.5"))
    config = session_config(pp=2, compile_mode="async", compile_timeout_s=job["compile_timeout_s"])
    session = RankSession.start(tokenizer, config, rank=rank)
    skewed = skew_compiles(session, delay_table(job["delays"][rank], job["base_delay"][rank]))
    manager = GramcoordStructuredOutputManager(session)
    t0 = time.perf_counter()
    try:
        if rank == 0:
            result = _pp_stage0(session, manager, tokenizer, job)
        else:
            result = _pp_stage1(session, manager, tokenizer)
    finally:
        skewed.stop.set()
        manager.clear_backend()
    result.update(rank=rank, wall_s=time.perf_counter() - t0)
    return result


def _pp_stage0(session, manager, tokenizer, job) -> dict:
    link = session.link
    scheduler = FakeScheduler(
        manager, stop_ids=tokenizer.stop_ids, max_num_seqs=16, grammar_remote=True
    )
    queue = make_requests(tokenizer, job["ids"], extra=job.get("extra", ()), max_tokens=48)
    per_step = job["per_step"]
    builder = session.builder is not None
    while True:
        arrivals = []
        for req in queue[:per_step]:
            outcome = scheduler.add_request(req)
            if outcome is None:
                arrivals.append((req.request_id, -1, ""))
            elif outcome.seq >= 0:
                arrivals.append((req.request_id, outcome.seq, json.dumps(req.params)))
        queue = queue[per_step:]
        done = not queue and not scheduler.has_unfinished_requests() and not arrivals
        msg = PPArrivals(scheduler.step + 1, done, arrivals)
        link.send(1, msgspec.msgpack.encode(msg), operation="arrivals", step=msg.step)
        if done:
            break
        so = scheduler.schedule()  # manager.update(step): the decision goes down the chain
        link.send(1, msgspec.msgpack.encode(so), operation="scheduler output", step=so.step)
        if not so.num_scheduled_tokens:
            time.sleep(IDLE_S)
            continue
        raw = link.recv(1, operation="model output", step=so.step)
        scheduler.update_from_output(so, msgspec.msgpack.decode(raw, type=ModelRunnerOutput))
    return dict(log=_log(scheduler), outputs=outputs_of(scheduler), builder=builder)


def _pp_stage1(session, manager, tokenizer) -> dict:
    link = session.link
    runner = FakeModelRunner(tokenizer, k=0, max_num_seqs=16)
    requests: dict[str, FakeRequest] = {}
    decided_log: list[tuple[int, list[str], list[tuple[str, str]]]] = []
    masked = 0
    try:
        while True:
            arr = msgspec.msgpack.decode(
                link.recv(0, operation="arrivals", step=-1), type=PPArrivals
            )
            if arr.done:
                break
            for rid, seq, spec_json in arr.requests:
                params = json.loads(spec_json) if spec_json else None
                req = FakeRequest(
                    rid, [], 0, None, params, StructuredOutputRequest.from_params(params)
                )
                requests[rid] = req
                if req.use_structured_output:
                    manager.grammar_init(req, seq=seq)
            decided = manager.update(arr.step)  # follows stage 0's decision
            decided_log.append(
                (
                    arr.step,
                    [o.request_id for o in decided.admitted],
                    [(o.request_id, o.code) for o in decided.failed],
                )
            )
            so = msgspec.msgpack.decode(
                link.recv(0, operation="scheduler output", step=arr.step), type=SchedulerOutput
            )
            for rid in so.finished_req_ids:
                manager.finish_request(rid)
            if runner.execute_model(so) is None:
                continue
            structured = [r for r in so.num_scheduled_tokens if requests[r].use_structured_output]
            errors: dict[str, tuple[str, str]] = {}
            for o in decided.stage_failed:
                errors[o.request_id] = (o.code, o.message)
            ready = [r for r in structured if session.is_running(r)]
            for r in structured:
                if r not in ready:
                    errors.setdefault(r, ("grammar_stage_timeout", "not compiled on stage 1"))
            go = None
            if ready:
                rows = manager.grammar_bitmask(requests, ready, so.scheduled_spec_decode_tokens)
                go = GrammarOutput(ready, rows)
                masked += len(ready)
            out = runner.sample_tokens(go)
            terminated = []
            for rid, tokens in zip(out.req_ids, out.sampled_token_ids):
                if rid in ready and tokens:
                    grammar = manager.grammar(rid)
                    if not grammar.accept_tokens(rid, tokens):
                        errors[rid] = (grammar.error.code.name, grammar.error.message)
                    elif grammar.is_terminated():
                        terminated.append(rid)
            out.errors, out.terminated = errors, terminated
            link.send(0, msgspec.msgpack.encode(out), operation="model output", step=so.step)
    finally:
        runner.close()
    return dict(decided=decided_log, masked_rows=masked, digests=runner.mask_digests)
