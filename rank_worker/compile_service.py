"""Grammar compilation: two xgrammar compilers, a bounded pool, deadlines.

The service owns *jobs*, not caches: a job is one compile of one key, shared
by every request that joined it. Results are handed to the manager, which
decides (at agreed points) what enters the compile and poison caches.

Deadlines are wall-clock from the moment a worker starts the compile. A
thread cannot be killed, so a compile that overruns keeps its worker: it is
counted as *stuck*. When stuck compiles occupy every worker the pool is
*saturated*: new misses, and jobs still queued, fail at once with
``grammar_pool_saturated`` instead of waiting behind them. Capacity comes
back as soon as a stuck compile returns.

In ``sync`` mode the compile runs inline and is never timed out: under an
external launcher every rank must reach the same verdict without a
collective, and a locally measured deadline would differ between ranks.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from coordinator.status import PendingState
from rank_worker.config import GrammarConfig
from rank_worker.errors import ErrorCode
from rank_worker.spec import GrammarSpec
from rank_worker.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CompileFn = Callable[[GrammarSpec], Any]


def _choice_ebnf(text: str) -> str:
    # EBNF string literals take JSON-style escapes, so json.dumps quotes
    # every option safely.
    options = json.loads(text)
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


class XGrammarBackend:
    """The real compilers: one per vocabulary view, chosen by spec kind."""

    def __init__(self, tokenizer: Tokenizer, *, max_threads: int = 1) -> None:
        kw = dict(max_threads=max_threads, cache_enabled=False)
        self.restricted = xgr.GrammarCompiler(tokenizer.info, **kw)
        self.full = xgr.GrammarCompiler(tokenizer.full_info, **kw)
        self._by_kind: dict[str, Callable[[xgr.GrammarCompiler, GrammarSpec], Any]] = {
            "json": lambda c, s: c.compile_json_schema(
                s.text, any_whitespace=s.any_whitespace, strict_mode=s.strict_mode
            ),
            "json_object": lambda c, s: c.compile_json_schema(
                '{"type": "object"}', any_whitespace=s.any_whitespace, strict_mode=False
            ),
            "regex": lambda c, s: c.compile_regex(s.text),
            "ebnf": lambda c, s: c.compile_grammar(s.text),
            "choice": lambda c, s: c.compile_grammar(_choice_ebnf(s.text)),
            "lark": lambda c, s: c.compile_lark(s.text),
            "structural_tag": lambda c, s: c.compile_structural_tag(s.text),
        }

    def __call__(self, spec: GrammarSpec) -> Any:
        compiler = self.full if spec.needs_full_vocab else self.restricted
        return self._by_kind[spec.kind](compiler, spec)


class CompileJob:
    """One compile of one key; requests that share the key join it."""

    def __init__(self, spec: GrammarSpec, submitted_at: float) -> None:
        self.spec = spec
        self.submitted_at = submitted_at
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.result: Any = None
        # (ErrorCode, message) once the job failed.
        self.error: tuple[ErrorCode, str] | None = None
        self.future: Future | None = None
        # Measured with perf_counter, independent of the (injectable)
        # deadline clock.
        self.compile_ms = 0.0
        self.done = threading.Event()

    @property
    def key(self) -> bytes:
        return self.spec.key

    def state(self) -> tuple[PendingState, int]:
        if self.error is not None:
            return PendingState.FAILED, int(self.error[0])
        if self.done.is_set():
            return PendingState.READY, 0
        return PendingState.PENDING, 0

    def fail(self, code: ErrorCode, message: str) -> None:
        if self.error is None and not self.done.is_set():
            self.error = (code, message)
            self.done.set()


class CompileService:
    """Compiles grammar specs asynchronously (or inline), with deadlines.

    Parameters
    ----------
    config:
        ``compile_mode``, ``compile_timeout_s`` and the pool size.
    compile_fn:
        ``GrammarSpec -> CompiledGrammar``; the xgrammar backend by default.
        Tests inject slow or failing functions here.
    clock:
        Monotonic seconds; injected by tests.
    """

    def __init__(
        self,
        config: GrammarConfig,
        compile_fn: CompileFn,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.sync = config.compile_mode == "sync"
        self.timeout_s = config.compile_timeout_s
        self.pool_size = config.pool_size
        self._compile = compile_fn
        self._clock = clock
        self._lock = threading.Lock()
        self._inflight: dict[bytes, CompileJob] = {}
        # Jobs a worker thread is executing right now, decided or not: a
        # timed-out job leaves _inflight but keeps its thread until it ends.
        self._running: set[CompileJob] = set()
        self._pool = (
            None
            if self.sync
            else ThreadPoolExecutor(self.pool_size, thread_name_prefix="gramcoord-compile")
        )
        self.num_compiles = 0

    # -- submission -------------------------------------------------------

    def inflight(self, key: bytes) -> CompileJob | None:
        return self._inflight.get(key)

    def submit(self, spec: GrammarSpec) -> tuple[CompileJob, bool]:
        """Start (or join) the compile of ``spec``; returns (job, joined)."""
        existing = self._inflight.get(spec.key)
        if existing is not None and not existing.done.is_set():
            return existing, True
        job = CompileJob(spec, self._clock())
        self._inflight[spec.key] = job
        self.num_compiles += 1
        if self._pool is None:
            self._run(job)
        elif self.num_stuck() >= self.pool_size:
            job.fail(
                ErrorCode.grammar_pool_saturated,
                f"all {self.pool_size} compile workers are stuck in compiles past "
                f"{self.timeout_s:g}s; retry later",
            )
        else:
            job.future = self._pool.submit(self._run, job)
        return job, False

    def _run(self, job: CompileJob) -> None:
        if job.done.is_set():  # failed while queued
            return
        job.started_at = self._clock()
        with self._lock:
            self._running.add(job)
        t0 = time.perf_counter()
        try:
            result = self._compile(job.spec)
            error = None
        except Exception as exc:  # any compile failure is the spec's fault
            result, error = None, (ErrorCode.grammar_invalid, f"{type(exc).__name__}: {exc}")
        job.compile_ms = (time.perf_counter() - t0) * 1e3
        job.finished_at = self._clock()
        with self._lock:
            self._running.discard(job)
            if job.done.is_set():  # timed out meanwhile: the late result is dropped
                return
            job.result, job.error = result, error
            job.done.set()
        if self.sync and job.compile_ms > self.timeout_s * 1e3:
            logger.warning(
                "sync compile of %s took %.0f ms (past compile_timeout_s, kept: sync mode "
                "never times out so every rank agrees)",
                job.key.hex()[:12],
                job.compile_ms,
            )

    # -- deadlines --------------------------------------------------------

    def num_stuck(self) -> int:
        """Compiles still running past their deadline (each holds a worker)."""
        now = self._clock()
        with self._lock:
            running = list(self._running)
        return sum(1 for j in running if now - (j.started_at or now) > self.timeout_s)

    def poll(self) -> None:
        """Fail jobs past their deadline; fail queued jobs if saturated."""
        if self._pool is None:
            return
        now = self._clock()
        with self._lock:
            for job in list(self._inflight.values()):
                if job.done.is_set():
                    continue
                if job.started_at is not None and now - job.started_at > self.timeout_s:
                    job.fail(
                        ErrorCode.grammar_timeout,
                        f"compile ran past grammar.compile_timeout_s={self.timeout_s:g}s",
                    )
        if self.num_stuck() >= self.pool_size:
            with self._lock:
                for job in self._inflight.values():
                    if job.started_at is None and not job.done.is_set():
                        if job.future is not None:
                            job.future.cancel()
                        job.fail(
                            ErrorCode.grammar_pool_saturated,
                            "every compile worker is stuck past its deadline; retry later",
                        )

    def forget(self, job: CompileJob) -> None:
        """Drop a finished job from the in-flight table (its key is decided)."""
        if self._inflight.get(job.key) is job and (job.done.is_set()):
            del self._inflight[job.key]

    def wait(self, job: CompileJob, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for ``job`` to finish; True if it did."""
        return job.done.wait(timeout_s)

    def close(self) -> None:
        if self._pool is not None:
            # Stuck compiles cannot be joined; do not wait for them.
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
