"""gramcoord as a vLLM 0.32 structured-output backend: real subclasses of vLLM's ABCs.

vLLM builds ``VllmBackend(vllm_config, tokenizer, vocab_size)``. The
vocabulary, stop ids and compile calls are vLLM's own (an
``XgrammarBackend`` inside supplies the tokenizer info and the calls), so
outputs are token-identical to vLLM + xgrammar; only the compiler under
those calls is ours, with one thread (``own_compiler``). gramcoord adds what vLLM
lacks: validation and keys, a compile cache and poison cache, compile
deadlines, and readiness agreed once per engine step. All of that is behind
one door, ``GrammarFutures.for_host`` over vLLM's TP group (Futures, because
vLLM's scheduler waits on one); what stays here is vLLM's: its compile
calls, its grammar objects, its call sites.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import xgrammar as xgr
from vllm.v1.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    StructuredOutputOptions,
)
from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend, XgrammarGrammar

from gramcoord.integrations.vllm.options import (
    front_end_config,
    parse,
    vllm_grammar_config,
    vocab_name,
)
from gramcoord.rank_worker.config import FaultsConfig
from gramcoord.rank_worker.errors import ErrorCode
from gramcoord.rank_worker.grammars.compile_job import started_threads, thread_ids
from gramcoord.rank_worker.grammars.compile_service import choice_ebnf
from gramcoord.rank_worker.grammars.end_check import end_check
from gramcoord.rank_worker.grammars.json_strings import SafeStrings
from gramcoord.rank_worker.grammars.outcome import Outcome
from gramcoord.rank_worker.grammars.spec import GrammarSpec
from gramcoord.rank_worker.session.futures import GrammarFutures, HostVocabulary

if TYPE_CHECKING:
    # Built only over a TP group (``group`` set).
    from gramcoord.integrations.vllm.tp_digest import MaskDigests

__all__ = [
    "COMPILE_THREADS",
    "GrammarInitError",
    "VllmBackend",
    "VllmGrammar",
    "front_end_config",
    "own_compiler",
    "vllm_grammar_config",
]

logger = logging.getLogger(__name__)

_KIND_TO_VLLM = {
    "json": StructuredOutputOptions.JSON,
    "json_object": StructuredOutputOptions.JSON_OBJECT,
    "regex": StructuredOutputOptions.REGEX,
    "ebnf": StructuredOutputOptions.GRAMMAR,
    "lark": StructuredOutputOptions.GRAMMAR,
    "structural_tag": StructuredOutputOptions.STRUCTURAL_TAG,
}


# xgrammar threads per compile. vLLM's compiler has 8; each compile thread
# of ours runs at nice +10 and xgrammar's threads inherit it, but CFS
# weights add up: 8 threads at nice 10 weigh about one at nice 0, so a slow
# compile took the engine loop's core from it (the loop ran 1.65x slower
# while it compiled; with one thread at nice 10, 1.00x). The compile pool
# runs several compiles at once instead.
COMPILE_THREADS = 1


def lone_compile_threads() -> int:
    """xgrammar threads of a compile that starts while nothing decodes: this
    process's CPUs, as vLLM's own compiler would use them. They still run at
    the compile pool's nice, so requests that arrive meanwhile keep
    precedence."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)


def own_compiler(host: XgrammarBackend, threads: int = COMPILE_THREADS) -> SafeStrings:
    """The compiler under vLLM's compile calls: ``host``'s tokenizer info, xgrammar's
    cache with vLLM's limit, ``threads`` threads; JSON strings kept free of raw
    control characters (``SafeStrings``).

    xgrammar starts a compile's threads inside each call (one thread: none,
    the caller compiles), so they inherit the calling thread's nice and CPUs.
    """
    import vllm.envs

    # vLLM keeps the tokenizer info only inside its compiler (vLLM's own
    # choice among HF, Mistral and PLaMo tokenizers); a one-rule grammar
    # compiled by it carries the very object out.
    tokenizer_info = host.compiler.compile_grammar('root ::= "a"').tokenizer_info
    compiler = xgr.GrammarCompiler(
        tokenizer_info,
        max_threads=threads,
        cache_enabled=True,
        cache_limit_bytes=vllm.envs.VLLM_XGRAMMAR_CACHE_MB * 1024 * 1024,
    )
    return SafeStrings(compiler)


class LoneCompile:
    """A compile started with every CPU: the threads xgrammar starts for it can be
    sent to nice 19 once requests decode beside it.

    xgrammar starts a compile's threads inside the call, and they inherit the
    compile thread's nice and its name: they are the compile's started
    threads, as its deadline reads them (``compile_job.started_threads``).
    The compile thread itself keeps its nice: it is a pool worker that later
    compiles run on.
    """

    def __init__(self, nice: int) -> None:
        self.tid = threading.get_native_id()
        # The threads alive as the compile starts; None: nothing to yield.
        self.before = thread_ids() if nice > 0 else None
        self.yielded = False

    def yield_cpus(self) -> None:
        """Nice 19 for the compile's own threads (once; raising a nice needs no privilege)."""
        if self.yielded or self.before is None:
            return
        self.yielded = True
        for tid in started_threads(self.tid, self.before):
            with contextlib.suppress(OSError):  # it ended meanwhile
                os.setpriority(os.PRIO_PROCESS, tid, 19)


class GrammarInitError(RuntimeError):
    """Why a request's grammar will never be ready; the same text on every rank."""

    def __init__(self, request_id: str, code: str, message: str) -> None:
        super().__init__(f"gramcoord: request {request_id!r}: {code}: {message}")
        self.request_id = request_id
        self.code = code
        self.message = message


def vllm_spec(request_type: StructuredOutputOptions, grammar_spec: str) -> dict[str, Any]:
    """The gramcoord spec (vLLM field names) of a vLLM structured-output key."""
    kind = request_type.name.lower()
    if kind == "json_object":
        return {"json_object": True}
    return {kind: grammar_spec}


@dataclass
class VllmGrammar(XgrammarGrammar):
    """One request's matcher: vLLM's own ``XgrammarGrammar`` (accept, validate,
    rollback, tokens after termination, bitmask fill), so the engine's
    per-token behaviour is exactly vLLM's; gramcoord decides only when it
    exists (the agreement).

    For a schema the grammar does not enforce whole (``check``: its text,
    ``GrammarSpec.end_check``) it also keeps the tokens it accepted: when
    the matcher terminates (it accepted a stop token), the output before
    that token is validated against the schema (``end_check``), and
    ``breach`` says why it breaks it. A rollback past the termination (a
    draft token) takes the verdict back."""

    request_id: str = ""
    check: str | None = None
    decode: Callable[[list[int]], str] | None = None
    tokens: list[int] = field(default_factory=list, repr=False)
    breach: str | None = None

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        if self.check is None:
            return super().accept_tokens(request_id, tokens)
        before, was = self.num_processed_tokens, self._is_terminated
        ok = super().accept_tokens(request_id, tokens)
        self.tokens.extend(tokens[: self.num_processed_tokens - before])
        if self._is_terminated and not was:
            # The last token is the stop token the matcher terminated on.
            self.breach = end_check(self.check, self.decode(self.tokens[:-1]))
        return ok

    def rollback(self, num_tokens: int) -> None:
        super().rollback(num_tokens)
        if self.check is not None and num_tokens > 0:
            del self.tokens[-num_tokens:]
            if not self._is_terminated:
                self.breach = None


@dataclass
class VllmBackend(StructuredOutputBackend):
    """vLLM's ``StructuredOutputBackend`` over gramcoord's door, ``GrammarFutures``."""

    group: Any = None

    def __post_init__(self) -> None:
        self.host = XgrammarBackend(self.vllm_config, self.tokenizer, self.vocab_size)
        # vLLM's own compile calls (request types, whitespace rule, tokenizer
        # info) over our single-threaded compiler; vLLM's 8-thread one goes.
        self.host.compiler = own_compiler(self.host)
        # The same calls over a compiler with every CPU, for a compile that
        # starts while nothing decodes (``_compile_spec``); made on first use.
        self._lone_host: XgrammarBackend | None = None
        self._lone_lock = threading.Lock()
        self._lone_compiles: set[LoneCompile] = set()
        # vLLM's scheduler, known from its first step (``before_schedule``).
        self._scheduler: Any = None
        self.vocab_size = self.host.vocab_size
        self.num_speculative_tokens = self.host.num_speculative_tokens
        so = self.vllm_config.structured_outputs_config
        extra = (self.vllm_config.additional_config or {}).get("gramcoord")
        options = parse(extra, bool(so.disable_any_whitespace))  # checked at start too
        self.config = options.grammar
        self.global_rank = int(os.environ.get("RANK", "0"))
        compile_fn: Callable[[Any], Any] = self._compile_spec
        flip_step = -1
        if options.faults != FaultsConfig():  # a drill: only then is fault injection loaded
            from gramcoord.rank_worker.faults import RankFaults

            faults = RankFaults.of(options.faults, self.global_rank)
            compile_fn, flip_step = faults.wrap_compile(compile_fn), faults.flip_step
        distributed = options.distributed
        vocab = vocab_name(self.vllm_config)
        self.grammars = GrammarFutures.for_host(
            self.config,
            HostVocabulary(vocab),
            compile_fn,
            self.group,
            distributed,
            admit=self._admitted,
            refuse=self._refused,
        )
        if self.vllm_config.parallel_config.data_parallel_size > 1:
            # Only data-parallel replicas share poison (``replicas``).
            from gramcoord.integrations.vllm.replicas import replica_poison

            poison = replica_poison(self.vllm_config)
            if poison is not None:
                self.grammars.join_replicas(poison)
        self.digests: MaskDigests | None = None
        if self.group is not None:
            from gramcoord.integrations.vllm.tp_digest import MaskDigests

            self.digests = MaskDigests(self.group, distributed, self._max_rows(), flip_step)
        self._stops: dict[str, set[int] | None] = {}
        # End-checked grammars by request, and the breaches of those freed
        # since the engine step's outputs were last read (failures.py).
        self._checked: dict[str, VllmGrammar] = {}
        self.breaches: dict[str, str] = {}
        logger.info(
            "gramcoord backend: vocabulary %s, agreement group of %d, %d compile workers",
            vocab,
            self.grammars.group_size,
            self.config.pool_size,
        )

    def _max_rows(self) -> int:
        """Most bitmask rows in one step: every sequence, each with its drafts."""
        seqs = self.vllm_config.scheduler_config.max_num_seqs
        return seqs * (1 + self.num_speculative_tokens)

    # -- compiling -------------------------------------------------------------

    def _compile_spec(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """A validated spec compiled exactly as vLLM's xgrammar backend compiles it.

        One xgrammar thread while requests decode (so the engine loop keeps
        its core); every CPU when none does at the compile's start (a lone
        request waits for nothing else: it compiles as fast as with vLLM's
        own backend). Should requests start decoding meanwhile, the threads
        xgrammar started for it drop to nice 19 (``before_schedule``). The
        grammar is the same either way.
        """
        if self._decoding():
            return self._compile_on(self.host, spec)
        host = self._lone()
        if host is self.host:
            return self._compile_on(host, spec)
        lone = LoneCompile(self.config.compile_nice)
        with self._lone_lock:
            self._lone_compiles.add(lone)
        try:
            return self._compile_on(host, spec)
        finally:
            with self._lone_lock:
                self._lone_compiles.discard(lone)

    @staticmethod
    def _compile_on(host: XgrammarBackend, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind == "choice":  # vLLM's validation turns choices into grammars first
            return host.compiler.compile_grammar(choice_ebnf(spec.text))
        text = "" if spec.kind == "json_object" else spec.text
        return host.compile_grammar(_KIND_TO_VLLM[spec.kind], text).ctx

    def _decoding(self) -> bool:
        """Whether vLLM's scheduler runs any request now (read on the compile thread)."""
        scheduler = self._scheduler
        return scheduler is not None and len(scheduler.running) > 0

    def _lone(self) -> XgrammarBackend:
        with self._lone_lock:
            if self._lone_host is None:
                threads = lone_compile_threads()
                if threads == COMPILE_THREADS:
                    self._lone_host = self.host
                else:
                    self._lone_host = copy.copy(self.host)
                    self._lone_host.compiler = own_compiler(self.host, threads)
            return self._lone_host

    def _grammar(
        self, ctx: xgr.CompiledGrammar, stop_token_ids: set[int] | None, request_id: str = ""
    ) -> VllmGrammar:
        """vLLM's grammar object over ``ctx``: one matcher, rollback for the drafts."""
        matcher = xgr.GrammarMatcher(
            ctx,
            override_stop_tokens=list(stop_token_ids) if stop_token_ids else None,
            max_rollback_tokens=self.num_speculative_tokens,
        )
        return VllmGrammar(
            vocab_size=self.vocab_size, matcher=matcher, ctx=ctx, request_id=request_id
        )

    def compile_grammar(
        self,
        request_type: StructuredOutputOptions,
        grammar_spec: str,
        stop_token_ids: set[int] | None = None,
    ) -> StructuredOutputGrammar:
        """vLLM's synchronous contract (not on the engine's path: see ``admit``)."""
        ctx = self.host.compile_grammar(request_type, grammar_spec).ctx
        return self._grammar(ctx, stop_token_ids)

    # -- the engine's path -----------------------------------------------------

    def admit(self, request: Any) -> None:
        """``grammar_init`` for gramcoord: the grammar slot gets a Future the agreement resolves."""
        sor = request.structured_output_request
        request_type, grammar_spec = sor.structured_output_key
        params = request.sampling_params
        self._stops[request.request_id] = params.all_stop_token_ids if params is not None else None
        sor.grammar = self.grammars.submit(
            request.request_id, vllm_spec(request_type, grammar_spec)
        )

    def _admitted(self, outcome: Outcome) -> VllmGrammar:
        rid = outcome.request_id
        grammar = self._grammar(self.grammars.compiled(rid), self._stops.pop(rid, None), rid)
        if outcome.end_check is not None:
            grammar.check, grammar.decode = outcome.end_check, self._decode
            self._checked[rid] = grammar
        return grammar

    def _decode(self, token_ids: list[int]) -> str:
        """An output's text as vLLM's detokenizer gives it (special tokens skipped)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _refused(self, outcome: Outcome) -> GrammarInitError:
        self._stops.pop(outcome.request_id, None)
        code = outcome.code or ErrorCode.grammar_internal.name
        return GrammarInitError(outcome.request_id, code, outcome.message)

    def before_schedule(self, num_unfinished: int, scheduler: Any = None) -> None:
        """Top of every ``Scheduler.schedule``: sleep briefly if only grammars are awaited,
        then agree (every rank, every step but those the gap skips: ``futures``)."""
        if self._scheduler is None:
            self._scheduler = scheduler
        undecided = self.grammars.num_undecided
        if undecided and num_unfinished <= undecided:
            self.grammars.wait(0.02)
        elif self._lone_compiles and num_unfinished > undecided:
            with self._lone_lock:
                for lone in self._lone_compiles:
                    lone.yield_cpus()
        self.grammars.step()

    def release(self, request_id: str) -> None:
        """``Scheduler._free_request``: the request ended, for whatever reason."""
        self._stops.pop(request_id, None)
        grammar = self._checked.pop(request_id, None)
        if grammar is not None and grammar.breach is not None:
            self.breaches[request_id] = grammar.breach
        self.grammars.release(request_id)

    def take_breaches(self) -> dict[str, str]:
        """The breaches of the requests freed since the last call (each read once)."""
        found, self.breaches = self.breaches, {}
        return found

    @property
    def num_live(self) -> int:
        """Requests whose state is still held here (0 once all ended)."""
        return self.grammars.num_live

    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(max_num_seqs, self.vocab_size)

    def destroy(self) -> None:
        self.grammars.close()
        self.host.destroy()
