"""gramcoord as an SGLang 0.5.23 grammar backend: real subclasses of SGLang's classes.

``create_grammar_backend`` builds ``SglangBackend`` through the registry
(``plugin.register``). The vocabulary, stop ids, whitespace options and
compile calls are SGLang's own: an ``XGrammarGrammarBackend`` inside
supplies the tokenizer info and compiles each spec as SGLang's xgrammar
backend compiles a key (the spec's kind and gramcoord's validated text:
``compiled_key``), and the grammar objects are SGLang's own
``XGrammarGrammar`` (accept, rollback, termination, the batched and
repeated mask fills of chunked prefill, jump-forward and retokenization,
``ValueError`` on a refused token). So masks are SGLang's, bit for bit,
except where gramcoord rewrote a schema into an equivalent that xgrammar
enforces whole (there SGLang's would let through what xgrammar drops).
gramcoord adds validation and keys, a bounded compile cache, a poison
cache with a TTL for timeouts (SGLang caches a timeout for ever), compile
deadlines, joined compiles of one key, and the agreement of when a grammar
is ready: one outcome on every rank of SGLang's sync group. All of that is
behind one door, ``GrammarFutures.for_host`` over SGLang's sync group; what
stays here is SGLang's: its compile calls, its grammar objects, and where
the agreement runs (``AgreedFuture.result``).

Where the agreement runs
------------------------
SGLang's ``GrammarManager.get_ready_grammar_requests`` polls each queued
request's grammar ``Future``, all_gathers the pickled sets of queue indices
whose ``Future`` is done, and then calls ``Future.result()`` on the
intersection, in the same order on every rank of its sync group. Here
``done()`` means the local compile finished (well or badly), and
``result()`` is where the ranks agree: its first call without a decision
runs the agreement's collective, and every rank decides the same (ready
everywhere, failed anywhere). Every rank reaches that collective, because
SGLang calls ``result()`` only after its own collective, on the same
requests, in the same order.

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
(``grammar_divergence``, with a message naming the ranks and the first
differing request).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
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

from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.errors import ErrorCode
from gramcoord.rank_worker.grammars.compile_service import CompileFn
from gramcoord.rank_worker.grammars.end_check import end_check
from gramcoord.rank_worker.grammars.json_strings import SafeStrings
from gramcoord.rank_worker.grammars.outcome import Outcome
from gramcoord.rank_worker.grammars.spec import GrammarSpec
from gramcoord.rank_worker.session.futures import GrammarFutures, HostVocabulary

__all__ = [
    "OPTIONS_ENV",
    "AgreedFuture",
    "SglangBackend",
    "SglangGrammar",
    "compiled_key",
    "options_from_env",
    "sglang_grammar_config",
    "sglang_spec",
]

logger = logging.getLogger(__name__)

# SGLang's json_schema value for "any JSON".
ANY_JSON = "$$ANY$$"
# gramcoord's spec kind -> SGLang's key type (json_object: ANY_JSON).
_KEY_TYPES = {"json": "json", "regex": "regex", "ebnf": "ebnf", "structural_tag": "structural_tag"}
_TIMED_OUT = "Grammar preprocessing timed out"
# SGLang's launch has no flag for a backend's options: the server's
# --grammar-backend gramcoord reads gramcoord's grammar options from this
# environment variable (a JSON object), which every scheduler process inherits.
OPTIONS_ENV = "GRAMCOORD_SGLANG_OPTIONS"
# The end of a refusal of features xgrammar would not enforce, under SGLang:
# the place that turns the refusal on also turns it off.
UNENFORCED_HINT = (
    "Remove these keywords, or set reject_ignored_features to false "
    f"({OPTIONS_ENV}, or sglang_grammar_config(reject_ignored_features=False) "
    "for an embedded backend), as SGLang's --grammar-backend gramcoord does by default"
)


def sglang_grammar_config(**options: Any) -> GrammarConfig:
    """The ``GrammarConfig`` for SGLang: the host decides which schemas it enforces.

    ``reject_ignored_features`` is off: SGLang's own schema check runs at
    compile and refuses what it does not enforce, and what it admits that
    the grammar enforces in part is checked at the end
    (``SglangGrammar.accept_token``); a compile pool of 2+
    so one slow compile does not queue the fast ones behind it, whose
    threads run at nice +10 so a compile storm cannot starve the scheduler.
    """
    options.setdefault("num_compile_workers", max(2, (os.cpu_count() or 2) // 2))
    options.setdefault("compile_nice", 10)
    options.setdefault("reject_ignored_features", False)
    options.setdefault("unenforced_hint", UNENFORCED_HINT)
    return msgspec.convert({**options, "compile_mode": "async"}, GrammarConfig)


def options_from_env(environ: Any = os.environ) -> GrammarConfig:
    """The server's ``GrammarConfig``: ``sglang_grammar_config`` with ``OPTIONS_ENV``'s options.

    ``GRAMCOORD_SGLANG_OPTIONS='{"store": {"dir": "/var/lib/gramcoord"}}'``
    takes the fields of gramcoord's ``grammar`` section (``docs/configuration.md``);
    unset or empty, the defaults.

    Raises
    ------
    ValueError
        Not a JSON object, an unknown field, a bad value, or ``compile_mode``
        (always async under SGLang): SGLang fails the launch with it.
    """
    at = f"{OPTIONS_ENV}."  # messages name a field as GRAMCOORD_SGLANG_OPTIONS.store.dir
    text = environ.get(OPTIONS_ENV, "").strip()
    if not text:
        return sglang_grammar_config(options_at=at)
    try:
        options = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{OPTIONS_ENV} is not JSON: {exc}") from None
    if not isinstance(options, dict):
        raise ValueError(
            f"{OPTIONS_ENV} must be a JSON object of gramcoord's grammar options, "
            f"not {type(options).__name__}"
        )
    if "compile_mode" in options:
        raise ValueError(
            f"{OPTIONS_ENV}: compile_mode cannot be set: compiles are always async under SGLang"
        )
    options.setdefault("options_at", at)
    try:
        return sglang_grammar_config(**options)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"{OPTIONS_ENV}: {exc}") from None


def sglang_spec(key: tuple[str, str]) -> dict[str, Any] | None:
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


def compiled_key(spec: GrammarSpec) -> tuple[str, str]:
    """The SGLang key a validated spec compiles as: its kind and gramcoord's text.

    The text is the one gramcoord validated and keyed: canonical, and for a
    JSON schema rewritten into an equivalent xgrammar enforces whole where
    one exists (``grammars.schema_rewrite``), as under vLLM. So the grammar
    depends on the key alone (two texts of one schema compile alike), a
    rewritten schema is enforced whole instead of xgrammar dropping what it
    does not enforce, and a spec store's warm compile is the request's.

    Raises
    ------
    ValueError
        A kind SGLang has no key for (``choice``, ``lark``: an operator's
        list may hold one).
    """
    if spec.kind == "json_object":
        return ("json", ANY_JSON)
    key_type = _KEY_TYPES.get(spec.kind)
    if key_type is None:
        raise ValueError(
            f"SGLang has no grammar kind for a {spec.kind!r} spec; it takes json, "
            "json_object, regex, grammar (EBNF) and structural_tag"
        )
    return (key_type, spec.text)


class AgreedFuture(Future):
    """A grammar ``Future`` whose value the ranks agree on in ``result()``."""

    def __init__(self, grammars: GrammarFutures, request_id: str) -> None:
        super().__init__()
        self._grammars = grammars
        self.request_id = request_id

    def done(self) -> bool:
        return super().done() or self._grammars.compiled_here(self.request_id)

    def result(self, timeout: float | None = None) -> Any:
        # Decide until this request is decided; every rank runs the same
        # rounds. Asked early (its compile not done anywhere), wait, never spin.
        while not super().done() and self._grammars.undecided(self.request_id):
            if not self._grammars.step():
                self._grammars.wait(0.05)
                time.sleep(0.001)
        return super().result(timeout)

    def cancel(self) -> bool:
        self._grammars.release(self.request_id)
        return super().cancel()


class SglangGrammar(XGrammarGrammar):
    """One request's matcher: SGLang's own ``XGrammarGrammar``, so every
    per-token behaviour SGLang's scheduler, batch and speculative code reads
    is SGLang's; gramcoord decides only when it exists.

    For a schema the grammar does not enforce whole (``check``: its text),
    the output before the stop token the matcher terminates on is checked
    against the schema (``end_check``); a breach raises ``ValueError``
    there, which SGLang's scheduler answers by finishing the request as an
    abort whose message is ``gramcoord schema_breach: ...``: never
    delivered as if valid."""

    check: str | None = None
    decode: Any = None

    def accept_token(self, token: int) -> None:
        was = self.is_terminated()
        super().accept_token(token)
        if self.check is None or was or not self.is_terminated():
            return
        why = end_check(self.check, self.decode(self.accepted_tokens[:-1]))
        if why is not None:
            raise ValueError(f"gramcoord {ErrorCode.schema_breach.name}: {why}")

    def copy(self) -> SglangGrammar:
        """A fresh matcher on the shared compiled grammar (SGLang's cache semantics)."""
        matcher = GrammarMatcher(
            self.ctx,
            max_rollback_tokens=MAX_ROLLBACK_TOKENS,
            override_stop_tokens=self.override_stop_tokens,
        )
        stats = self.grammar_stats
        if stats is not None:
            stats = dataclasses.replace(stats, is_cache_hit=True, tree_traversal_time=[])
        grammar = SglangGrammar(
            matcher, self.vocab_size, self.ctx, self.override_stop_tokens, self.key_string, stats
        )
        grammar.check, grammar.decode = self.check, self.decode
        return grammar

    @staticmethod
    def reset_vocab_mask(vocab_mask: torch.Tensor) -> None:
        """Back to unconstrained: every bit set, as a fresh xgrammar bitmask."""
        vocab_mask.fill_(-1)


class SglangBackend(BaseGrammarBackend):
    """SGLang's ``BaseGrammarBackend`` over gramcoord's door, ``GrammarFutures``.

    Parameters
    ----------
    tokenizer, vocab_size, eos_token_ids:
        What ``create_grammar_backend`` passes (the model's EOS ids are the stops).
    any_whitespace, max_whitespace_cnt:
        SGLang's ``constrained_json_*`` options.
    config:
        gramcoord's grammar options (``sglang_grammar_config()`` by default).
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
        self._tokenizer = tokenizer
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
        self.config = config or sglang_grammar_config()
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        compile_fn: CompileFn = self._compile
        if compile_hook is not None:
            compile_fn = compile_hook(compile_fn)
        vocab = HostVocabulary(f"sglang:{name}:{vocab_size}")
        self.grammars = GrammarFutures.for_host(
            self.config,
            vocab,
            compile_fn,
            group,
            admit=self._admitted,
            refuse=self._refused,
            max_gap=1,
        )
        # request id -> SGLang's key (for the grammar object of an admitted one).
        self._keys: dict[str, tuple[str, str]] = {}
        self._next = 0
        logger.info(
            "gramcoord SGLang backend: vocabulary of %d, sync group of %d, %d compile workers",
            vocab_size,
            self.grammars.group_size,
            self.config.pool_size,
        )

    # -- compiling -------------------------------------------------------------

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile ``spec`` as SGLang's xgrammar backend compiles its key (``compiled_key``)."""
        grammar = self.host._init_value_dispatch(compiled_key(spec), False)
        if isinstance(grammar, InvalidGrammarObject):
            raise ValueError(grammar.error_message)
        return grammar.ctx

    def _from_ctx(
        self, ctx: CompiledGrammar, key: tuple[str, str], hit: bool, check: str | None
    ) -> SglangGrammar:
        matcher = GrammarMatcher(
            ctx,
            max_rollback_tokens=MAX_ROLLBACK_TOKENS,
            override_stop_tokens=self.host.override_stop_tokens,
        )
        stats = GrammarStats(dispatch_type=key[0], is_cache_hit=hit)
        grammar = SglangGrammar(
            matcher, self.vocab_size, ctx, self.host.override_stop_tokens, key[1], stats
        )
        if check is not None:
            grammar.check, grammar.decode = check, self._decode
        return grammar

    def _decode(self, token_ids: list[int]) -> str:
        """An output's text as SGLang's detokenizer gives it (special tokens skipped)."""
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def _admitted(self, outcome: Outcome) -> SglangGrammar:
        rid = outcome.request_id
        try:
            compiled, key = self.grammars.compiled(rid), self._keys.pop(rid)
            return self._from_ctx(compiled, key, False, outcome.end_check)
        finally:
            # SGLang keeps the grammar object; the compiled grammar stays cached.
            self.grammars.release(rid)

    def _refused(self, outcome: Outcome) -> InvalidGrammarObject:
        self._keys.pop(outcome.request_id, None)
        code = outcome.code or ErrorCode.grammar_internal.name
        return InvalidGrammarObject(f"{code}: {outcome.message}")

    def _submit(self, key: tuple[str, str], spec: dict[str, Any]) -> AgreedFuture:
        rid = f"sglang-{self._next}"
        self._next += 1
        self._keys[rid] = key
        return self.grammars.submit(rid, spec, AgreedFuture(self.grammars, rid))

    # -- SGLang's calls --------------------------------------------------------

    def get_cached_or_future_value(
        self, key: tuple[str, str], require_reasoning: bool
    ) -> tuple[BaseGrammarObject | Future, bool]:
        """A cached grammar (or a cached refusal), else an ``AgreedFuture``."""
        spec = sglang_spec(key)
        if spec is None:
            done: Future = Future()
            done.set_result(InvalidGrammarObject(f"Invalid key_type: {key[0]}"))
            return done, False
        found = self.grammars.lookup(spec)
        if found.compiled is not None:
            grammar = self._from_ctx(found.compiled, key, True, found.end_check)
            grammar.maybe_init_reasoning(require_reasoning)
            return grammar, True
        if found.failed is not None:
            # The stored text is the failing rank's own; a group aborts with one text.
            failed = found.failed
            why = (
                failed.message
                if self.grammars.group_size == 1
                else "cached verdict, no compile ran for this request: this grammar failed earlier"
            )
            return InvalidGrammarObject(f"{failed.code}: {why}"), True
        return self._submit(key, spec), False

    def set_cache(self, key: tuple[str, str], value: BaseGrammarObject) -> None:
        """Admitted grammars are cached at the decision; a timeout poisons for a TTL."""
        if not isinstance(value, InvalidGrammarObject) or value.error_message != _TIMED_OUT:
            return
        spec = sglang_spec(key)
        if spec is not None:
            self.grammars.poison(spec, ErrorCode.grammar_timeout, _TIMED_OUT)

    def reset(self) -> None:
        """SGLang's ``flush_cache``: drop compiled grammars (poison is agreed state, kept)."""
        super().reset()
        self.grammars.clear_cache()
        self.host.reset()

    def close(self) -> None:
        """Stop the compile pool (SGLang never calls it; tests and shutdown do)."""
        self.grammars.close()
        self.executor.shutdown(wait=False)
