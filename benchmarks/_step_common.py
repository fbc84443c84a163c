"""What the three step loops of ``gramcoord bench step`` share.

- ``BenchRequest`` and ``bench_requests``: the workload slice every way runs
  (the constrained json / regex records of ``configs/workload.jsonl`` that
  are not meant to fail), optionally copied under new ids;
- ``RunClock``: wraps the logits source and the sampler on every rank and
  times xgrammar's mask kernel. Every way calls the model exactly once per
  loop step, so the gap between two forward calls is one step's wall time,
  and that minus the forward is the step's overhead; minus also the logits
  work every way does alike (mask kernel, greedy pick) it is the step's
  coordination. No loop needs a timing hook of its own;
- ``finish_reason``: the one finishing rule (ours: ``ModelRunner._accept``
  with K = 0), so the baselines end a request where ours does;
- ``Compiler``: xgrammar with the compiler settings ours uses
  (``max_threads=1``, the restricted vocabulary, ``any_whitespace`` and
  ``strict_mode`` from ``GrammarConfig``);
- ``RankRun``: what one rank hands back for one run.
"""

from __future__ import annotations

import bisect
import itertools
import json
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
import xgrammar as xgr

from gramcoord.engine.acceptance import finish_reason
from gramcoord.engine.models import ModelRequest, SyntheticModel
from gramcoord.engine.requests import EngineRequest
from gramcoord.engine.sampler import Sampler
from gramcoord.launch.workload import read_workload
from gramcoord.rank_worker.config import GrammarConfig, SamplingConfig
from gramcoord.rank_worker.errors import SpecError
from gramcoord.rank_worker.grammars.spec import validate_spec
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer

# The spec kinds both baselines compile the same way ours does.
KINDS = ("json", "regex")
DEFAULT_MAX_TOKENS = 256


class BenchRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    # "json" or "regex".
    kind: str
    # The schema as JSON text, or the regex pattern: what a user sends.
    text: str
    # The structured_outputs mapping as the workload has it (ours takes it).
    raw: dict
    reference: str | None
    max_tokens: int

    def engine_request(self) -> EngineRequest:
        return EngineRequest(
            request_id=self.request_id,
            spec=self.raw,
            max_tokens=self.max_tokens,
            reference=self.reference,
        )

    def model_request(self) -> ModelRequest:
        # Prompt ids are left out: the synthetic model never reads them.
        return ModelRequest(self.request_id, (), self.reference)


def bench_requests(
    path: Path, *, limit: int = 0, copies: int = 1, max_tokens: int = 0
) -> list[BenchRequest]:
    """The constrained json / regex records of ``path`` that should succeed.

    Records ours refuses at admission (features xgrammar would not enforce)
    are left out too: the baselines would run them unenforced, so the
    outputs could not be compared.

    ``copies > 1`` repeats the slice under ids ``ID#k`` (k >= 1): larger
    batches with the same grammars (compile-cache hits everywhere).
    ``max_tokens > 0`` caps every request's output, so batches stay full
    for most steps instead of thinning out into a tail of long requests.
    """
    expected_errors = set()
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            if rec.get("expect_error"):
                expected_errors.add(rec.get("id"))
    base: list[BenchRequest] = []
    for rec in read_workload(path):
        spec = rec.spec if isinstance(rec.spec, dict) else {}
        if rec.error or rec.id in expected_errors or len(spec) != 1:
            continue
        ((kind, value),) = spec.items()
        if kind not in KINDS:
            continue
        try:
            validate_spec(spec, GrammarConfig())
        except SpecError:
            continue
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        base.append(
            BenchRequest(
                request_id=rec.id,
                kind=kind,
                text=text,
                raw=spec,
                reference=rec.reference,
                max_tokens=min(rec.max_tokens or DEFAULT_MAX_TOKENS, max_tokens or 1 << 30),
            )
        )
        if limit and len(base) >= limit:
            break
    out = list(base)
    for k in range(1, copies):
        out += [msgspec.structs.replace(r, request_id=f"{r.request_id}#{k}") for r in base]
    return out


def replica_share(requests: Sequence[BenchRequest], *, dp: int, replica: int) -> list:
    """A replica's requests: every ``dp``-th, as ours partitions them."""
    return list(requests[replica::dp])


class Compiler:
    """xgrammar compiles with ours' settings (``compile_service.XGrammarBackend``)."""

    def __init__(self, tokenizer: Tokenizer, grammar: GrammarConfig | None = None) -> None:
        self.grammar = grammar or GrammarConfig()
        limit = int(self.grammar.cache_limit_mb * 2**20) // 2
        self.compiler = xgr.GrammarCompiler(
            tokenizer.info, max_threads=1, cache_enabled=True, cache_limit_bytes=limit
        )

    def __call__(self, request: BenchRequest) -> xgr.CompiledGrammar:
        if request.kind == "json":
            return self.compiler.compile_json_schema(
                request.text,
                any_whitespace=self.grammar.any_whitespace,
                strict_mode=self.grammar.strict_mode,
            )
        return self.compiler.compile_regex(request.text)


class Output(msgspec.Struct, frozen=True):
    """What the three ways must agree on, per request."""

    status: str
    finish_reason: str
    token_ids: list[int]


def take_token(req, token: int, stop_ids: frozenset[int]) -> Output | None:
    """A baseline request (``.request``, ``.matcher``, ``.out``) takes ``token``:
    its final ``Output`` if that ends it, else None."""
    if not req.matcher.accept_token(token):
        return Output("failed", "error", list(req.out))
    req.out.append(token)
    reason = finish_reason(
        terminated=req.matcher.is_terminated(),
        accepted=(token,),
        length=len(req.out),
        max_tokens=req.request.max_tokens,
        stop_ids=stop_ids,
    )
    return None if reason is None else Output("ok", reason, list(req.out))


class RankRun(msgspec.Struct, kw_only=True):
    """One rank's part of one run."""

    way: str
    rank: int
    # Per forward call: (start, end) in perf_counter seconds, and the rows.
    calls: list[tuple[float, float, int]]
    # (start, end) of each call of the logits work every way does alike
    # after the forward: xgrammar's mask kernel and the greedy pick.
    logits_work: list[tuple[float, float]] = msgspec.field(default_factory=list)
    # Per forward call on stage leaders: (request id, output position) of
    # each row, so the floor can refill the very batches of the run.
    batches: list[list[tuple[str, int]]] = msgspec.field(default_factory=list)
    # Stage-0 leaders: request id -> output.
    outputs: dict[str, Output] = msgspec.field(default_factory=dict)
    # Ours: the step loop's own per-step timings (``Timings``), by name.
    timings: dict[str, list[float]] = msgspec.field(default_factory=dict)


class RunClock:
    """One rank's clock for one run: forward calls and the logits work.

    ``timed`` gives the synthetic model and the greedy sampler, wrapped;
    xgrammar's ``apply_token_bitmask_inplace`` is timed through
    ``KERNEL_HOOK``, which every way reaches through the module attribute.
    """

    def __init__(self, *, record_batches: bool) -> None:
        self.calls: list[tuple[float, float, int]] = []
        self.batches: list[list[tuple[str, int]]] = []
        self.logits_work: list[tuple[float, float]] = []
        self._record = record_batches
        KERNEL_HOOK.sink = self.logits_work

    def timed(self, tokenizer: Tokenizer) -> tuple[_TimedModel, _TimedSampler]:
        """The logits source and the sampler every way runs, timed by this clock."""
        model, sampler = SyntheticModel(tokenizer), Sampler(SamplingConfig())
        return _TimedModel(model, self), _TimedSampler(sampler, self)

    def close(self) -> None:
        KERNEL_HOOK.sink = None

    def result(self, way: str, rank: int, outputs: dict, **kw) -> RankRun:
        """What this rank hands back for the run: the clock's records and ``outputs``."""
        return RankRun(
            way=way,
            rank=rank,
            calls=self.calls,
            batches=self.batches,
            logits_work=self.logits_work,
            outputs=outputs,
            **kw,
        )


class _TimedModel:
    def __init__(self, model, clock: RunClock) -> None:
        self.model, self.clock = model, clock
        self.vocab_size = model.vocab_size

    def logits(self, rows):
        clock = self.clock
        t0 = time.perf_counter()
        out = self.model.logits(rows)
        clock.calls.append((t0, time.perf_counter(), len(rows)))
        if clock._record:
            clock.batches.append([(req.request_id, len(ids)) for req, ids in rows])
        return out


class _TimedSampler:
    def __init__(self, sampler, clock: RunClock) -> None:
        self.inner, self.clock = sampler, clock

    def sample(self, logits, keys):
        t0 = time.perf_counter()
        picks = self.inner.sample(logits, keys)
        self.clock.logits_work.append((t0, time.perf_counter()))
        return picks


class _KernelHook:
    """Times ``xgrammar.apply_token_bitmask_inplace`` into the current clock."""

    def __init__(self) -> None:
        self.sink: list[tuple[float, float]] | None = None
        self._inner = None

    def install(self) -> None:
        if self._inner is not None:
            return
        self._inner = inner = xgr.apply_token_bitmask_inplace

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            inner(*args, **kwargs)
            if self.sink is not None:
                self.sink.append((t0, time.perf_counter()))

        xgr.apply_token_bitmask_inplace = timed


KERNEL_HOOK = _KernelHook()


def step_samples_ms(run: RankRun) -> list[tuple[float, float]]:
    """Per step with rows: (overhead, coordination) in ms.

    Overhead = the gap to the next forward call minus the forward;
    coordination = overhead minus the logits work started in that gap.
    """
    work = sorted(run.logits_work)
    starts = [w[0] for w in work]
    out = []
    for (_, e0, n), (s1, _, _) in itertools.pairwise(run.calls):
        if not n:
            continue
        lo, hi = bisect.bisect_left(starts, e0), bisect.bisect_left(starts, s1)
        busy = sum(b - a for a, b in work[lo:hi])
        overhead = (s1 - e0) * 1e3
        out.append((overhead, overhead - busy * 1e3))
    return out


def forward_ms(calls: Sequence[tuple[float, float, int]]) -> list[float]:
    return [(e - s) * 1e3 for s, e, n in calls[:-1] if n > 0]
