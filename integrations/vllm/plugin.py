"""The vLLM plugin: ``register()`` makes ``backend="gramcoord"`` a vLLM 0.32 backend.

vLLM loads it through the ``vllm.general_plugins`` entry point in every
process. ``LLM(...)`` validates its ``StructuredOutputsConfig`` before
plugins load, so offline code calls ``register()`` (or imports this module)
before ``LLM(...)``; ``vllm serve`` needs nothing. This is the only module
that changes vLLM's behaviour; every internal it touches is in ``INTERNALS``
(``test_plugin_internals`` checks each one still exists with the same
signature).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import logging
import threading
import typing
from typing import Any

from gramcoord.integrations.internals import check, check_version

__all__ = ["INTERNALS", "NAME", "SUPPORTED", "register"]

logger = logging.getLogger(__name__)

NAME = "gramcoord"
# Supported vLLM versions: 0.32.x, verified on 0.32.0.
SUPPORTED = "0.32"
VERIFIED = "0.32.0"

# Every vLLM internal used, as (module, attribute, parameters or None, why).
INTERNALS: tuple[tuple[str, str, tuple[str, ...] | None, str], ...] = (
    (
        "vllm.config.structured_outputs",
        "StructuredOutputsBackend",
        None,
        "the closed Literal of backend names, widened with 'gramcoord'",
    ),
    (
        "vllm.config.structured_outputs",
        "StructuredOutputsConfig._validate_structured_output_config",
        ("self",),
        "allows disable_any_whitespace with gramcoord (pydantic validator, rebuilt)",
    ),
    (
        "vllm.config",
        "VllmConfig",
        None,
        "rebuilt (pydantic) so it sees the widened backend config",
    ),
    (
        "vllm.sampling_params",
        "SamplingParams._validate_structured_outputs",
        ("self", "model_config", "structured_outputs_config", "tokenizer"),
        "front-end validation: vLLM's xgrammar rules, then ours (VLLMValidationError, 400)",
    ),
    (
        "vllm.v1.structured_output.backend_guidance",
        "validate_guidance_grammar",
        ("sampling_params", "tokenizer"),
        "imported by vLLM's validation on the first structured request; a spec store's "
        "warm start imports it before",
    ),
    (
        "vllm.v1.structured_output.backend_lm_format_enforcer",
        "validate_structured_output_request_lm_format_enforcer",
        ("params",),
        "the same",
    ),
    (
        "vllm.v1.structured_output.backend_outlines",
        "validate_structured_output_request_outlines",
        ("params",),
        "the same",
    ),
    (
        "vllm.v1.structured_output.backend_xgrammar",
        "has_xgrammar_unsupported_json_features",
        ("schema",),
        "skipped inside gramcoord's validation: it serves those features, end-checked",
    ),
    (
        "vllm.v1.structured_output.backend_xgrammar",
        "XgrammarGrammar.accept_tokens",
        ("self", "request_id", "tokens"),
        "end-checked grammars keep the tokens they accept and check at termination",
    ),
    (
        "vllm.v1.structured_output.backend_xgrammar",
        "XgrammarGrammar.rollback",
        ("self", "num_tokens"),
        "a rollback past the termination takes the end check's verdict back",
    ),
    (
        "vllm.v1.structured_output",
        "StructuredOutputManager.__init__",
        ("self", "vllm_config"),
        "with a spec store, builds VllmBackend at engine start: the warm start begins there",
    ),
    (
        "vllm.v1.structured_output",
        "StructuredOutputManager.grammar_init",
        ("self", "request"),
        "builds VllmBackend before the if/elif; the grammar slot gets our Future",
    ),
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler.schedule",
        ("self", "throttle_prefills"),
        "the agreement, once per engine step on every rank; the scheduler's running list "
        "says whether a compile starts alone",
    ),
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler._free_request",
        ("self", "request", "delay_free_blocks"),
        "request end or abort releases our state",
    ),
    (
        "vllm.distributed.parallel_state",
        "get_tp_group",
        (),
        "the agreement group under external_launcher: the TP group's gloo cpu_group",
    ),
    (
        "vllm.v1.structured_output.backend_xgrammar",
        "XgrammarBackend.compile_grammar",
        ("self", "request_type", "grammar_spec", "stop_token_ids"),
        "vLLM's tokenizer info and compile calls, reused for identical outputs (over "
        "the plugin's one-thread compiler, set as its `compiler`)",
    ),
    (
        "vllm.v1.structured_output.backend_xgrammar",
        "XgrammarGrammar",
        ("vocab_size", "matcher", "ctx", "_is_terminated"),
        "subclassed: vLLM's own per-token accept, validate, rollback and bitmask fill",
    ),
    (
        "vllm.v1.engine.llm_engine",
        "LLMEngine.has_unfinished_requests_dp",
        ("self", "has_unfinished"),
        "DP replicas (external_launcher) share poison at vLLM's per-step DP all_reduce",
    ),
    (
        "vllm.distributed.parallel_state",
        "get_dp_group",
        (),
        "the group between DP replicas under external_launcher: its gloo cpu_group",
    ),
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler.get_grammar_bitmask",
        ("self", "scheduler_output"),
        "TP mask digests: each TP rank's bitmask rows, once per engine step",
    ),
    (
        "vllm.engine.arg_utils",
        "EngineArgs.create_engine_config",
        ("self", "usage_context", "headless"),
        "options.py: additional_config['gramcoord'] is checked before any engine starts",
    ),
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler.update_from_output",
        ("self", "scheduler_output", "model_runner_output"),
        "failures.py: the FINISHED_ERROR output of a request in grammar_compile_error_reqs "
        "gets stop_reason 'gramcoord <code>: <message>'; one log line (a request whose TP "
        "masks differ fails that way too)",
    ),
    (
        "vllm.v1.structured_output.request",
        "StructuredOutputRequest._grammar",
        None,
        "failures.py: where a grammar Future that raised leaves its exception",
    ),
    (
        "vllm.v1.engine.output_processor",
        "RequestState.make_request_output",
        (
            "self",
            "new_token_ids",
            "pooling_output",
            "finish_reason",
            "stop_reason",
            "kv_transfer_params",
            "ec_transfer_params",
            "error",
        ),
        "failures.py: a server request's payload becomes a GracefulHTTPError in its queue",
    ),
    (
        "vllm.exceptions",
        "GracefulHTTPError",
        ("message", "http_status"),
        "failures.py: subclassed; vLLM's serving layer answers with its status and message",
    ),
    ("vllm.v1.engine", "FinishReason.ERROR", None, "failures.py: a request vLLM failed"),
)


def _check_version() -> None:
    check_version("vLLM", "vllm", SUPPORTED, VERIFIED)


def _widen_backend_literal() -> None:
    import vllm.config.structured_outputs as so
    from pydantic.dataclasses import rebuild_dataclass

    names = typing.get_args(so.StructuredOutputsBackend)
    widened = typing.Literal[(*names, NAME)]  # type: ignore[valid-type]
    so.StructuredOutputsBackend = widened
    cls = so.StructuredOutputsConfig
    cls.__annotations__["backend"] = widened
    cls.__dataclass_fields__["backend"].type = widened
    cls.__pydantic_fields__["backend"].annotation = widened
    validator = cls.__pydantic_decorators__.model_validators["_validate_structured_output_config"]
    original = validator.func

    @functools.wraps(original)
    def check(self: Any) -> Any:
        if self.backend == NAME:  # disable_any_whitespace is ours too
            return original(dataclasses.replace(self, backend="xgrammar")) and self
        return original(self)

    validator.func = check
    rebuild_dataclass(cls, force=True)
    from vllm.config import VllmConfig

    rebuild_dataclass(VllmConfig, force=True)  # it embeds the config's validator


def _wrap_validation() -> None:
    import vllm.v1.structured_output.backend_xgrammar as vllm_xgrammar
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    from gramcoord.integrations.vllm.backend import front_end_config
    from gramcoord.rank_worker.errors import SpecError
    from gramcoord.rank_worker.grammars.spec import validate_spec

    original = SamplingParams._validate_structured_outputs
    # vLLM refuses JSON-Schema features xgrammar leaves unenforced
    # (uniqueItems, multipleOf on numbers, a length beside a pattern, ...).
    # gramcoord serves them and checks the finished output against the
    # schema, so under gramcoord (and only inside its validation: the flag
    # is per thread) vLLM's own rules skip that list; gramcoord's validation
    # decides.
    unsupported = vllm_xgrammar.has_xgrammar_unsupported_json_features
    ours = threading.local()

    @functools.wraps(unsupported)
    def has_unsupported(schema):
        return False if getattr(ours, "validating", False) else unsupported(schema)

    vllm_xgrammar.has_xgrammar_unsupported_json_features = has_unsupported

    @functools.wraps(original)
    def validate(self, model_config, structured_outputs_config, tokenizer):
        so = self.structured_outputs
        if structured_outputs_config is None or so is None:
            return original(self, model_config, structured_outputs_config, tokenizer)
        if structured_outputs_config.backend != NAME:
            return original(self, model_config, structured_outputs_config, tokenizer)
        if so._backend not in (None, NAME):
            raise VLLMValidationError(
                f"Request-level structured output backend selection is not supported: the "
                f"request specified {so._backend!r}, vLLM was initialised with {NAME!r}"
            )
        so._backend = None
        as_xgrammar = dataclasses.replace(structured_outputs_config, backend="xgrammar")
        ours.validating = True
        try:
            original(self, model_config, as_xgrammar, tokenizer)  # vLLM's own rules first
        except VLLMValidationError as exc:
            raise VLLMValidationError(
                _for_the_client(exc), parameter=exc.parameter, value=exc.value
            ) from exc
        finally:
            ours.validating = False
        spec = {
            f: getattr(so, f)
            for f in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
            if getattr(so, f) is not None
        }
        if "json" in spec and not isinstance(spec["json"], str):
            # The text the engine core compiles (vLLM's structured-output key
            # dumps an object schema): one verdict per text in each process.
            # What cannot be dumped is left for validation to refuse.
            with contextlib.suppress(TypeError, ValueError, RecursionError):
                spec["json"] = json.dumps(spec["json"])
        config = front_end_config(bool(structured_outputs_config.disable_any_whitespace))
        try:
            validate_spec(spec, config)
        except SpecError as exc:
            raise VLLMValidationError(
                f"gramcoord refused the structured output request ({exc.code.name}): {exc.message}",
                parameter="structured_outputs",
            ) from exc
        so._backend = NAME
        so._backend_was_auto = False

    SamplingParams._validate_structured_outputs = validate


def _for_the_client(exc: Exception) -> str:
    """vLLM's refusal in words for the client: xgrammar's own text (with its
    position: ``Regex parsing error at position 4``, ``EBNF parser error at
    line 1, column 11``) instead of vLLM's bare "Invalid grammar
    specification.", without the log time and C++ source path xgrammar
    prefixes it with."""
    from gramcoord.rank_worker.errors import clean_native_message

    text = clean_native_message(str(exc))
    cause = exc.__cause__
    if cause is not None:
        detail = clean_native_message(str(cause))
        if detail and detail not in text:
            text = f"{text.rstrip('.')}: {detail}"
    return text


def agreement_group(vllm_config: Any) -> Any | None:
    """The ranks that run schedulers over the same request stream, or ``None``.

    Under ``external_launcher`` every TP rank runs its own scheduler: the
    group is vLLM's TP group (its gloo ``cpu_group``). Otherwise one
    scheduler serves the TP group: no agreement collective is needed.
    """
    parallel = vllm_config.parallel_config
    if parallel.distributed_executor_backend != "external_launcher":
        return None
    if parallel.tensor_parallel_size <= 1:
        return None
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().cpu_group


def _build_backend(manager: Any) -> None:
    """Make ``manager``'s backend ours (once): agreement group, async compile."""
    from gramcoord.integrations.vllm.backend import VllmBackend

    config = manager.vllm_config
    manager.backend = VllmBackend(
        config,
        tokenizer=manager.tokenizer,
        vocab_size=config.model_config.get_vocab_size(),
        group=agreement_group(config),
    )
    # The agreement makes async compile safe under external_launcher.
    manager._use_async_grammar_compilation = True


def _store_at_start(vllm_config: Any) -> Any:
    """The spec store's options when the engine runs gramcoord with a store dir or an
    operator's list (its warm start begins with the engine), else ``None``."""
    so = vllm_config.structured_outputs_config
    if so is None or so.backend != NAME or vllm_config.model_config.skip_tokenizer_init:
        return None
    from gramcoord.integrations.vllm.options import parse

    extra = (vllm_config.additional_config or {}).get("gramcoord")
    store = parse(extra, bool(so.disable_any_whitespace)).grammar.store
    return store if store.dir is not None or store.preload else None


def _wrap_manager() -> None:
    from vllm.v1.structured_output import StructuredOutputManager

    from gramcoord.integrations.vllm.backend import VllmBackend

    init = StructuredOutputManager.__init__
    original = StructuredOutputManager.grammar_init

    @functools.wraps(init)
    def made(self, vllm_config):
        init(self, vllm_config)
        if _store_at_start(vllm_config) is not None:  # stored specs compile from the start
            _build_backend(self)
            _warm_apply()

    @functools.wraps(original)
    def grammar_init(self, request):
        sor = request.structured_output_request
        if sor is None:
            return original(self, request)
        if self.backend is None and sor.params._backend == NAME:
            _build_backend(self)
        if isinstance(self.backend, VllmBackend):
            return self.backend.admit(request)
        return original(self, request)

    StructuredOutputManager.__init__ = made
    StructuredOutputManager.grammar_init = grammar_init


# What vLLM's validation (``SamplingParams._validate_structured_outputs``)
# imports on the first structured request of a process, whatever the backend
# (INTERNALS lists them).
_FIRST_REQUEST_IMPORTS = (
    "vllm.v1.structured_output.backend_guidance",
    "vllm.v1.structured_output.backend_lm_format_enforcer",
    "vllm.v1.structured_output.backend_outlines",
)


def _import_first_request_modules() -> None:
    """What vLLM's validation imports on the first structured request (about 30 ms
    here): a warm start has it imported before."""
    for name in _FIRST_REQUEST_IMPORTS:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def _warm_apply() -> None:
    """With a spec store, apply one bitmask in the engine's process at start.

    Off the request path, on a thread at nice 19: xgrammar imports its CPU
    kernel on the first apply, which a restarted server's first structured
    request would otherwise pay (the worker runs in this process unless
    vLLM starts worker processes).
    """

    def run() -> None:
        import torch
        import xgrammar as xgr

        from gramcoord.rank_worker.grammars.spec_store import lowest_priority

        lowest_priority()
        logits = torch.zeros((1, 32), dtype=torch.float32)
        xgr.apply_token_bitmask_inplace(logits, xgr.allocate_token_bitmask(1, 32))

    threading.Thread(target=run, name="gramcoord-warm-apply", daemon=True).start()


def _warm_front_end(vllm_config: Any) -> None:
    """With a spec store, validate its specs in this (the front end's) process too.

    Off the request path, on a thread at nice 19: the first request for a
    stored spec after a restart then finds its verdict remembered
    (``spec.admit``) and the validation modules imported, as a repeated
    request does.
    """
    store = _store_at_start(vllm_config)
    if store is None:
        return
    from gramcoord.integrations.vllm.options import front_end_config, vocab_name

    disable_any_whitespace = bool(vllm_config.structured_outputs_config.disable_any_whitespace)
    config = front_end_config(disable_any_whitespace)
    vocab = vocab_name(vllm_config)

    def run() -> None:
        _import_first_request_modules()
        from gramcoord.rank_worker.errors import SpecError
        from gramcoord.rank_worker.grammars.spec import validate_spec
        from gramcoord.rank_worker.grammars.spec_store import SpecStore, gather, lowest_priority

        lowest_priority()
        opened = None
        if store.dir is not None:
            with contextlib.suppress(OSError):  # the engine says so
                opened = SpecStore(
                    store.dir, vocab, max_records=store.max_records,
                    max_spec_bytes=config.max_spec_bytes,
                )  # fmt: skip
        for stored in gather(opened, store.preload, config.max_spec_bytes)[0]:
            with contextlib.suppress(SpecError):
                validate_spec(stored.spec, config)

    threading.Thread(target=run, name="gramcoord-front-end-warm", daemon=True).start()


def _share_vllm_logging() -> None:
    """gramcoord's log lines through vLLM's handlers, at INFO, as vLLM's own.

    vLLM configures only its ``vllm`` logger: without this, gramcoord's
    INFO lines (the backend it built, the spec store's warm start) never
    reach the server's log.
    """
    ours = logging.getLogger("gramcoord")
    handlers = logging.getLogger("vllm").handlers
    if ours.handlers or not handlers:
        return
    for handler in handlers:
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False


def _wrap_scheduler() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from gramcoord.integrations.vllm.backend import VllmBackend

    schedule = Scheduler.schedule
    free = Scheduler._free_request
    bitmask = Scheduler.get_grammar_bitmask

    @functools.wraps(schedule)
    def scheduled(self, *args, **kwargs):
        backend = self.structured_output_manager.backend
        if isinstance(backend, VllmBackend):
            backend.before_schedule(self.get_num_unfinished_requests(), self)
        return schedule(self, *args, **kwargs)

    @functools.wraps(free)
    def freed(self, request, *args, **kwargs):
        backend = self.structured_output_manager.backend
        if isinstance(backend, VllmBackend) and request.structured_output_request:
            backend.release(request.request_id)
        return free(self, request, *args, **kwargs)

    @functools.wraps(bitmask)
    def digested(self, scheduler_output):
        out = bitmask(self, scheduler_output)
        backend = self.structured_output_manager.backend
        if isinstance(backend, VllmBackend) and backend.digests is not None:
            backend.digests.observe(self, scheduler_output, out)
        return out

    Scheduler.schedule = scheduled
    Scheduler._free_request = freed
    Scheduler.get_grammar_bitmask = digested


def _wrap_dp_step() -> None:
    from vllm.v1.engine.llm_engine import LLMEngine

    original = LLMEngine.has_unfinished_requests_dp

    @functools.wraps(original)
    def has_unfinished_requests_dp(self, has_unfinished):
        # vLLM calls this with DP > 1 only: one replica never loads ``replicas``.
        from gramcoord.integrations.vllm.replicas import sync_replicas

        sync_replicas(self.vllm_config)
        return original(self, has_unfinished)

    LLMEngine.has_unfinished_requests_dp = has_unfinished_requests_dp


def check_internals() -> list[str]:
    """What is missing or changed among ``INTERNALS`` (empty when all match)."""
    return check(INTERNALS)


_registered = False


def register() -> None:
    """Make ``structured_outputs_config={"backend": "gramcoord"}`` work; idempotent.

    Raises
    ------
    RuntimeError
        vLLM is not 0.32.x, or an internal the plugin patches changed.
    """
    global _registered
    if _registered:
        return
    _check_version()
    problems = check_internals()
    if problems:
        raise RuntimeError("gramcoord's vLLM plugin cannot patch vLLM: " + "; ".join(problems))
    _share_vllm_logging()
    _widen_backend_literal()
    _wrap_validation()
    _wrap_manager()
    _wrap_scheduler()
    _wrap_dp_step()
    from gramcoord.integrations.vllm import failures, options

    options.install(_warm_front_end)  # a bad additional_config['gramcoord'] stops the start
    failures.install()  # a grammar failed in the engine reaches the client
    _registered = True
    logger.info("gramcoord: registered the %r structured-output backend", NAME)
