"""Grammar compilation: two xgrammar compilers, a bounded pool, deadlines.

The service owns *jobs*, not caches: a job is one compile of one key, shared
by every request that joined it. Results are handed to the manager, which
decides (at agreed points) what enters the compile and poison caches.

A deadline runs from the moment a worker starts the compile and counts the
compile's own time: what it computed or blocked, never the time its thread
waited for a CPU (``compile_job``: a loaded machine makes a compile slower,
not timed out),
with ``grammar.compile_wall_timeout_s`` bounding the wall time. A
thread cannot be killed, so a compile that overruns keeps its thread: it is
counted as *stuck*, and a spare worker takes its place so the pool keeps
its capacity (the stuck thread exits when its compile returns). If the
process exits while one still runs, ``native_exit`` ends it with its own
status before the interpreter finalizes under the compile. Only when
``grammar.num_stuck_compiles`` compiles are stuck at once is the pool
*saturated*: new misses, and jobs still queued, fail at once with
``grammar_pool_saturated`` instead of waiting behind them.

NOTE: a fixed pool without replacement (the simple design) saturates on the
first stuck compile when the pool has one worker, which is the default on a
2-core machine: `gramcoord check` on the 600 dev schemas then reported 125
of them saturated.

A killable subprocess compile was measured and rejected: a persistent
worker process that compiles and ships the ``CompiledGrammar`` back
(``serialize_json`` + ``deserialize_json``) costs 1.2-1.8x a thread compile
at the median and up to 83x for one schema, the serialized grammar reaching
84 MB, plus 1.5-5 s to start the worker (``gramcoord bench compile``, row
``thread_compile``).

In ``sync`` mode the compile runs inline and is never timed out: under an
external launcher every rank must reach the same verdict without a
collective, and a locally measured deadline would differ between ranks.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import xgrammar as xgr

from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.errors import ErrorCode, clean_native_message
from gramcoord.rank_worker.grammars.compile_job import (
    CompileJob,
    ThreadReader,
    name_compile_thread,
    no_reading,
    read_compile_threads,
    thread_ids,
)
from gramcoord.rank_worker.grammars.json_strings import SafeStrings
from gramcoord.rank_worker.grammars.native_exit import native_call
from gramcoord.rank_worker.grammars.spec import GrammarSpec

if TYPE_CHECKING:  # hosts compile with their own tokenizer info
    from gramcoord.rank_worker.grammars.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CompileFn = Callable[[GrammarSpec], Any]


def choice_ebnf(text: str) -> str:
    # EBNF string literals take JSON-style escapes, so json.dumps quotes
    # every option safely.
    options = json.loads(text)
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


def compile_error_message(exc: BaseException) -> str:
    """A failed compile's message, the same on every rank and in every run.

    xgrammar's C++ errors carry a wall-clock time and a source path
    (``RuntimeError: [02:57:44] /project/cpp/...cc:94: Regex parsing error
    ...``); only the exception type and the meaningful text are kept.
    """
    text = clean_native_message(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class XGrammarBackend:
    """The real compilers: one per vocabulary view, chosen by spec kind.

    xgrammar's own cache is on. It is not a second result cache that we
    rely on (the manager's ``CompileCache`` decides what is kept and for how
    long); it makes *cold* compiles of new keys cheaper, because xgrammar
    reuses work across grammars that share rules. Measured on 60-80 dev
    schemas with the Qwen2.5 vocabulary, each new to both compilers, order
    alternated: median CPU per cold compile 0.7-1.0 ms with the cache
    against 13.8-14.0 ms without, and the first mask row of every grammar
    identical (51/51); ``gramcoord bench compile`` reports it as
    ``cold_compile_xgr_cache_on``. ``cache_limit_bytes`` bounds it; the
    two compilers share ``grammar.cache_limit_mb`` half and half.
    """

    def __init__(
        self, tokenizer: Tokenizer, *, max_threads: int = 1, cache_limit_bytes: int = 128 << 20
    ) -> None:
        self._kw = dict(
            max_threads=max_threads,
            cache_enabled=True,
            cache_limit_bytes=max(1, cache_limit_bytes // 2),
        )
        self._tokenizer = tokenizer
        # JSON strings keep raw control characters out (``json_strings``).
        self.restricted = SafeStrings(xgr.GrammarCompiler(tokenizer.info, **self._kw))
        # Built on first use: only Lark and structural tags need it.
        self._full: SafeStrings | None = None
        self._full_lock = threading.Lock()
        self._by_kind: dict[str, Callable[[xgr.GrammarCompiler, GrammarSpec], Any]] = {
            "json": lambda c, s: c.compile_json_schema(
                s.text, any_whitespace=s.any_whitespace, strict_mode=s.strict_mode
            ),
            "json_object": lambda c, s: c.compile_json_schema(
                '{"type": "object"}', any_whitespace=s.any_whitespace, strict_mode=False
            ),
            "regex": lambda c, s: c.compile_regex(s.text),
            "ebnf": lambda c, s: c.compile_grammar(s.text),
            "choice": lambda c, s: c.compile_grammar(choice_ebnf(s.text)),
            "lark": lambda c, s: c.compile_lark(s.text),
            "structural_tag": lambda c, s: c.compile_structural_tag(s.text),
        }

    @property
    def full(self) -> SafeStrings:
        """The compiler over the vocabulary with special tokens' text."""
        with self._full_lock:
            if self._full is None:
                info = self._tokenizer.full_info
                self._full = SafeStrings(xgr.GrammarCompiler(info, **self._kw))
            return self._full

    def __call__(self, spec: GrammarSpec) -> Any:
        compiler = self.full if spec.needs_full_vocab else self.restricted
        return self._by_kind[spec.kind](compiler, spec)


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
    thread_times:
        The CPU time, run-queue waits and state of a compile's threads
        (``compile_job``), from which the deadline takes the compile's own
        time; none under an injected clock by default.
    """

    def __init__(
        self,
        config: GrammarConfig,
        compile_fn: CompileFn,
        *,
        clock: Callable[[], float] = time.monotonic,
        thread_times: ThreadReader | None = None,
    ) -> None:
        self.sync = config.compile_mode == "sync"
        self.timeout_s = config.compile_timeout_s
        self.wall_timeout_s = config.wall_timeout_s
        self._names = (config.option("compile_timeout_s"), config.option("compile_wall_timeout_s"))
        if thread_times is None:
            thread_times = read_compile_threads if clock is time.monotonic else no_reading
        self._thread_times = thread_times
        self.pool_size = config.pool_size
        self.stuck_limit = config.stuck_limit
        self.nice = config.compile_nice
        self._compile = compile_fn
        self._clock = clock
        self._lock = threading.Lock()
        self._inflight: dict[bytes, CompileJob] = {}
        # Jobs a worker thread is executing right now, decided or not: a
        # timed-out job leaves _inflight but keeps its thread until it ends.
        self._running: set[CompileJob] = set()
        self._queue: queue.SimpleQueue[CompileJob | None] = queue.SimpleQueue()
        self._num_threads = 0
        self._closed = False
        self.num_compiles = 0
        if not self.sync:
            for _ in range(self.pool_size):
                self._spawn_worker()

    def _spawn_worker(self) -> None:
        self._num_threads += 1
        t = threading.Thread(
            target=self._worker, name=f"gramcoord-compile-{self._num_threads}", daemon=True
        )
        t.start()

    def _worker(self) -> None:
        _lower_priority(self.nice)
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._run(job)
            if job.replaced:
                return

    # -- submission -------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def inflight(self, key: bytes) -> CompileJob | None:
        return self._inflight.get(key)

    def submit(self, spec: GrammarSpec) -> tuple[CompileJob, bool]:
        """Start (or join) the compile of ``spec``; returns (job, joined).

        A job stays joinable until every request using it was decided, also
        after it finished: a result waiting for its decision is reused, and
        a failure is shared (its key is poisoned at that decision). Only a
        job that never ran (saturated, aborted) is replaced by a new one.
        """
        with self._lock:
            existing = self._inflight.get(spec.key)
            joins = existing is not None and (
                existing.started_at is not None or not existing.done.is_set()
            )
            if joins:
                existing.users += 1
            else:
                job = CompileJob(spec)
                job.users = 1
                self._inflight[spec.key] = job
                self.num_compiles += 1
        if joins:
            if self.sync:  # a warm-start compile of the key: inline means done at admission
                existing.done.wait()
            return existing, True
        if self.sync:
            self._run(job)
        elif self.num_stuck() >= self.stuck_limit:
            job.fail(
                ErrorCode.grammar_pool_saturated,
                f"{self.stuck_limit} compiles are stuck past {self.timeout_s:g}s "
                "(grammar.num_stuck_compiles); retry later",
            )
        else:
            self._queue.put(job)
        return job, False

    def warm(self, spec: GrammarSpec) -> CompileJob | None:
        """Compile ``spec`` on the calling thread (the spec store's), for no request yet.

        The job is in flight while it runs and after, so a request for the
        key joins it instead of compiling; the caller holds it (one user)
        until a request takes it or it is dropped (``release``). ``None``
        when the key is in flight already or the service is closed. The
        deadline is the same as any compile's; a stuck warm compile never
        gets a spare worker (it holds none).
        """
        with self._lock:
            if self._closed or spec.key in self._inflight:
                return None
            job = CompileJob(spec)
            job.users, job.warm, job.replaced = 1, True, True
            self._inflight[spec.key] = job
            self.num_compiles += 1
        self._run(job)
        return job

    def _run(self, job: CompileJob) -> None:
        # One critical section: poll/close must never fail a job that a
        # worker has already claimed.
        with self._lock:
            if job.done.is_set():  # failed or released while queued
                return
            tid = threading.get_native_id()
            if self.sync:  # no deadline, nothing to read (and the caller's thread keeps its name)
                job.start(tid, self._clock(), None)
            else:
                name_compile_thread()
                before = thread_ids()
                job.start(tid, self._clock(), self._thread_times(tid, before), before)
            self._running.add(job)
        t0 = time.perf_counter()
        try:
            # Every compile function (ours, vLLM's or SGLang's compiler) is
            # counted: the process may exit while it runs (``native_exit``).
            with native_call():
                result = self._compile(job.spec)
            error = None
        except Exception as exc:  # any compile failure is the spec's fault
            result, error = None, (ErrorCode.grammar_invalid, compile_error_message(exc))
        job.compile_ms = (time.perf_counter() - t0) * 1e3
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

    def _overrun(self, job: CompileJob, now: float) -> str | None:
        return job.overrun(
            now, self.timeout_s, self.wall_timeout_s, self._thread_times, self._names
        )

    def num_stuck(self) -> int:
        """Compiles still running past their deadline (each holds a worker)."""
        now = self._clock()
        # Under the lock: a job in _running has a live thread (its worker
        # leaves _running under the lock before it may end), whose times
        # can still be read.
        with self._lock:
            return sum(1 for j in self._running if self._overrun(j, now) is not None)

    def poll(self) -> None:
        """Fail jobs past their deadline, replace their workers, and fail
        queued jobs when saturated."""
        if self.sync or self._closed:
            return
        now = self._clock()
        with self._lock:
            overdue = []
            for job in self._running:
                why = self._overrun(job, now)
                if why is not None:
                    overdue.append((job, why))
            for job, why in overdue:
                job.fail(ErrorCode.grammar_timeout, why)
                # Replace the worker unless the stuck budget is spent (then
                # the pool is saturated and nothing more should start).
                if not job.replaced and len(overdue) < self.stuck_limit:
                    job.replaced = True
                    self._spawn_worker()
        if self.num_stuck() >= self.stuck_limit:
            with self._lock:
                for job in self._inflight.values():
                    if job.started_at is None and not job.done.is_set():
                        job.fail(
                            ErrorCode.grammar_pool_saturated,
                            f"{self.stuck_limit} compiles are stuck past their deadline; "
                            "retry later",
                        )

    def release(self, job: CompileJob) -> None:
        """One request no longer needs ``job``; the last one frees it.

        A released job leaves the in-flight table; if it never started it is
        failed (``aborted``) so no worker compiles it for nobody.
        """
        with self._lock:
            job.users -= 1
            if job.users > 0:
                return
            if job.started_at is None and not job.done.is_set():
                job.error = (ErrorCode.aborted, "no request needs this compile any more")
                job.done.set()
            if self._inflight.get(job.key) is job:
                del self._inflight[job.key]

    def wait(self, job: CompileJob, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for ``job`` to finish; True if it did."""
        return job.done.wait(timeout_s)

    def close(self) -> None:
        """Stop the workers; stuck compiles are daemon threads, not joined."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            for job in self._inflight.values():
                if job.started_at is None:
                    job.fail(ErrorCode.aborted, "compile service closed")
        for _ in range(self._num_threads):
            self._queue.put(None)


def _lower_priority(increment: int) -> None:
    """Lower the calling thread's CPU priority by ``increment`` (Linux: nice is
    per thread, and threads it starts inherit it); a no-op elsewhere."""
    if increment <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)
    except OSError as exc:  # a sandbox may forbid it; compiles still run
        logger.debug("compile thread priority unchanged: %s", exc)
