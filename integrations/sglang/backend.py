"""gramcoord as an SGLang 0.5.23 grammar backend: real subclasses of SGLang's classes.

``create_grammar_backend`` builds ``GramcoordBackend`` through the registry
(``plugin.register``). The vocabulary, stop ids, whitespace options and
compile calls are SGLang's own: an ``XGrammarGrammarBackend`` inside
supplies the tokenizer info and compiles each key exactly as SGLang's
xgrammar backend does, and the grammar objects are SGLang's own
``XGrammarGrammar`` (accept, rollback, termination, the batched and
repeated mask fills of chunked prefill, jump-forward and retokenization,
``ValueError`` on a refused token). So masks are SGLang's, bit for bit.
gramcoord adds validation and keys, a bounded compile cache, a poison
cache with a TTL for timeouts (SGLang caches a timeout for ever), compile
deadlines, joined compiles of one key, and the agreement of when a grammar
is ready (``agreement``): one outcome on every rank of SGLang's sync group.

Where the sync runs
-------------------
SGLang's scheduler calls ``get_ready_grammar_requests`` only under
``has_waiting_grammars()``, and that call all_gathers over the sync group
(``get_dp_tp_group()``: the attention-TP group with DP attention, else the
TP group) whenever the group has more than one rank. SGLang broadcasts
every request inside that group before ``process_req_with_grammar``, so
the grammar queues are identical as long as every per-rank choice that
could put a request in the queue on one rank and not on another is the
same everywhere. Here those choices (cache hit, poisoned key, refused
spec) change only at agreed points (the decision inside ``result()``,
``set_cache`` and ``reset``, which SGLang runs on every rank alike), and
poison TTLs run on the agreed clock. A host that hands a request to some
ranks of the group only is outside what a backend can repair: SGLang's own
all_gather then waits on the rank with the request until the group's
timeout; where both queues are non-empty the fingerprint check fails every
pending request on every rank rather than admit a mismatched one
(``agreement.AgreementDivergence``'s message).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from concurrent.futures import Future
from typing import Any

import msgspec
import torch
from sglang.srt.constrained.base_grammar_backend import (
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarStats,
    InvalidGrammarObject,
)
from sglang.srt.constrained.xgrammar_backend import (
    MAX_ROLLBACK_TOKENS,
    XGrammarGrammar,
    XGrammarGrammarBackend,
)
from xgrammar import CompiledGrammar, GrammarMatcher

from gramcoord.integrations.sglang.agreement import Agreement
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.errors import ErrorCode, SpecError
from gramcoord.rank_worker.grammars.caches import CompileCache, PoisonKind
from gramcoord.rank_worker.grammars.compile_service import CompileFn
from gramcoord.rank_worker.grammars.json_strings import SafeStrings
from gramcoord.rank_worker.grammars.manager import GrammarManager
from gramcoord.rank_worker.grammars.spec import GrammarSpec, validate_spec

__all__ = ["GramcoordBackend", "GramcoordGrammar", "grammar_config", "spec_of"]

logger = logging.getLogger(__name__)

# SGLang's json_schema value for "any JSON".
ANY_JSON = "$$ANY$$"
_TIMED_OUT = "Grammar preprocessing timed out"


def grammar_config(**options: Any) -> GrammarConfig:
    """The ``GrammarConfig`` for SGLang: the host decides which schemas it enforces.

    ``reject_ignored_features`` is off (SGLang's own schema check runs at
    compile and refuses what it does not enforce); a compile pool of 2+
    so one slow compile does not queue the fast ones behind it, whose
    threads run at nice +10 so a compile storm cannot starve the scheduler.
    """
    options.setdefault("num_compile_workers", max(2, (os.cpu_count() or 2) // 2))
    options.setdefault("compile_nice", 10)
    options.setdefault("reject_ignored_features", False)
    return msgspec.convert({**options, "compile_mode": "async"}, GrammarConfig)


def spec_of(key: tuple[str, str]) -> dict[str, Any] | None:
    """The gramcoord spec of SGLang's grammar key, or ``None`` for a kind SGLang refuses."""
    key_type, text = key
    if key_type == "json":
        return {"json_object": True} if text == ANY_JSON else {"json": text}
    if key_type == "regex":
        return {"regex": text}
    if key_type in ("ebnf", "full_assistant_ebnf"):
        return {"grammar": text}
    if key_type == "structural_tag":
        return {"structural_tag": text}
    return None


def _digest(key: tuple[str, str]) -> bytes:
    return hashlib.blake2b("\0".join(key).encode("utf-8", "surrogatepass"), digest_size=16).digest()


class GramcoordGrammar(XGrammarGrammar):
    """One request's matcher: SGLang's own ``XGrammarGrammar``, so every
    per-token behaviour SGLang's scheduler, batch and speculative code reads
    is SGLang's; gramcoord decides only when it exists."""

    def copy(self) -> GramcoordGrammar:
        """A fresh matcher on the shared compiled grammar (SGLang's cache semantics)."""
        matcher = GrammarMatcher(
            self.ctx,
            max_rollback_tokens=MAX_ROLLBACK_TOKENS,
            override_stop_tokens=self.override_stop_tokens,
        )
        stats = self.grammar_stats
        if stats is not None:
            stats = dataclasses.replace(stats, is_cache_hit=True, tree_traversal_time=[])
        return GramcoordGrammar(
            matcher, self.vocab_size, self.ctx, self.override_stop_tokens, self.key_string, stats
        )

    @staticmethod
    def reset_vocab_mask(vocab_mask: torch.Tensor) -> None:
        """Back to unconstrained: every bit set, as a fresh xgrammar bitmask."""
        vocab_mask.fill_(-1)


class GramcoordBackend(BaseGrammarBackend):
    """SGLang's ``BaseGrammarBackend`` over a gramcoord ``GrammarManager``.

    Parameters
    ----------
    tokenizer, vocab_size, eos_token_ids:
        What ``create_grammar_backend`` passes (the model's EOS ids are the stops).
    any_whitespace, max_whitespace_cnt:
        SGLang's ``constrained_json_*`` options.
    config:
        gramcoord's grammar options (``grammar_config()`` by default).
    group:
        SGLang's sync group as a gloo process group; ``None`` decides alone.
    compile_hook:
        Wraps the compile function (tests inject slow or failing compiles).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Any = None,
        *,
        any_whitespace: bool = True,
        max_whitespace_cnt: int | None = None,
        config: GrammarConfig | None = None,
        group: Any = None,
        compile_hook: Any = None,
    ) -> None:
        super().__init__()
        self.host = XGrammarGrammarBackend(
            tokenizer,
            vocab_size=vocab_size,
            model_eos_token_ids=list(eos_token_ids) if eos_token_ids else None,
            any_whitespace=any_whitespace,
            max_whitespace_cnt=max_whitespace_cnt,
        )
        # SGLang's own compiles, with JSON strings kept free of raw control characters.
        self.host.grammar_compiler = SafeStrings(self.host.grammar_compiler)
        self.vocab_size = vocab_size
        self.config = config or grammar_config()
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        compile_fn: CompileFn = self._compile
        if compile_hook is not None:
            compile_fn = compile_hook(compile_fn)
        self.manager = GrammarManager(
            self.config, _Vocab(f"sglang:{name}:{vocab_size}"), compile_fn=compile_fn
        )
        self.agreement = Agreement(self.manager, self._grammar, InvalidGrammarObject, group)
        # spec key -> SGLang's key, compiled as SGLang's backend compiles it.
        self._origin: dict[bytes, tuple[str, str]] = {}
        logger.info(
            "gramcoord SGLang backend: vocabulary of %d, sync group of %d, %d compile workers",
            vocab_size,
            self.agreement.size,
            self.config.pool_size,
        )

    # -- compiling -------------------------------------------------------------

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        grammar = self.host._init_value_dispatch(self._origin[spec.key], False)
        if isinstance(grammar, InvalidGrammarObject):
            raise ValueError(grammar.error_message)
        return grammar.ctx

    def _from_ctx(self, ctx: CompiledGrammar, key: tuple[str, str], hit: bool) -> GramcoordGrammar:
        matcher = GrammarMatcher(
            ctx,
            max_rollback_tokens=MAX_ROLLBACK_TOKENS,
            override_stop_tokens=self.host.override_stop_tokens,
        )
        stats = GrammarStats(dispatch_type=key[0], is_cache_hit=hit)
        return GramcoordGrammar(
            matcher, self.vocab_size, ctx, self.host.override_stop_tokens, key[1], stats
        )

    def _grammar(self, request_id: str, key: tuple[str, str]) -> GramcoordGrammar:
        return self._from_ctx(self.manager.compiled(request_id), key, False)

    # -- SGLang's calls --------------------------------------------------------

    def get_cached_or_future_value(
        self, key: tuple[str, str], require_reasoning: bool
    ) -> tuple[BaseGrammarObject | Future, bool]:
        """A cached grammar (or a cached refusal), else an ``AgreedFuture``."""
        spec = spec_of(key)
        if spec is None:
            done: Future = Future()
            done.set_result(InvalidGrammarObject(f"Invalid key_type: {key[0]}"))
            return done, False
        try:
            gspec = validate_spec(spec, self.config, vocab=self.manager.tokenizer.name)
        except SpecError:  # refused at the next get-ready call, as SGLang refuses its own
            return self.agreement.submit(_digest(key), spec, key), False
        compiled = self.manager.cache.get(gspec.key)
        if compiled is not None:
            grammar = self._from_ctx(compiled, key, True)
            grammar.maybe_init_reasoning(require_reasoning)
            return grammar, True
        poisoned = self.manager.poison.get(gspec.key, self.manager.agreed_ms)
        if poisoned is not None:
            code = ErrorCode.name_of(poisoned.reason)
            # The stored text is the failing rank's own; the group aborts with one text.
            why = poisoned.message if self.agreement.size == 1 else "failed earlier in the group"
            return InvalidGrammarObject(f"{code}: poisoned key: {why}"), True
        self._origin.setdefault(gspec.key, key)
        return self.agreement.submit(_digest(key), spec, key), False

    def set_cache(self, key: tuple[str, str], value: BaseGrammarObject) -> None:
        """Admitted grammars are cached at the decision; a timeout poisons for a TTL."""
        if not isinstance(value, InvalidGrammarObject) or value.error_message != _TIMED_OUT:
            return
        spec = spec_of(key)
        try:
            gspec = validate_spec(spec, self.config, vocab=self.manager.tokenizer.name)
        except (SpecError, TypeError):
            return
        reason = int(ErrorCode.grammar_timeout)
        self.manager.poison.poison(
            gspec.key, PoisonKind.TIMEOUT, reason, _TIMED_OUT, self.manager.agreed_ms
        )

    def reset(self) -> None:
        """SGLang's ``flush_cache``: drop compiled grammars (poison is agreed state, kept)."""
        super().reset()
        old = self.manager.cache
        self.manager.cache = CompileCache(max_bytes=old.max_bytes, max_entries=old.max_entries)
        self.host.reset()

    def close(self) -> None:
        """Stop the compile pool (SGLang never calls it; tests and shutdown do)."""
        self.manager.close()
        self.executor.shutdown(wait=False)


class _Vocab:
    """What the manager needs of a vocabulary: its name (part of every key)."""

    def __init__(self, name: str) -> None:
        self.name = name
