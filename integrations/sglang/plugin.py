"""The SGLang plugin: ``register()`` makes ``--grammar-backend gramcoord`` an SGLang backend.

SGLang 0.5.23 has a sanctioned extension point: ``create_grammar_backend``
looks the configured name up in ``GRAMMAR_BACKEND_REGISTRY`` first
(``register_grammar_backend(name, init_func)``), and
``add_grammar_backend_choices`` widens the CLI's choices. ``register()``
uses both and patches nothing. SGLang runs it itself as a general plugin
(entry point group ``sglang.srt.plugins``, loaded by ``launch_server`` and
``Engine`` before arguments are parsed, and in every scheduler process)
once the installed gramcoord declares ``gramcoord =
"gramcoord.integrations.sglang.plugin:register"`` in that group; without
the entry point, call it before ``ServerArgs`` is parsed, in every process. Every SGLang internal this package touches is in
``INTERNALS``; ``check_internals`` (run by the tests and by ``register``)
checks each still exists with the parameters expected.
"""

from __future__ import annotations

import logging
from typing import Any

from gramcoord.integrations.internals import check, check_version

__all__ = ["INTERNALS", "NAME", "SUPPORTED", "check_internals", "create_backend", "register"]

logger = logging.getLogger(__name__)

NAME = "gramcoord"
# Supported SGLang versions: 0.5.x, verified on 0.5.23.
SUPPORTED = "0.5"
VERIFIED = "0.5.23"

# Every SGLang internal used, as (module, attribute, parameters or None, why).
INTERNALS: tuple[tuple[str, str, tuple[str, ...] | None, str], ...] = (
    (
        "sglang.srt.constrained.base_grammar_backend",
        "register_grammar_backend",
        ("name", "init_func"),
        "the registry create_grammar_backend consults first",
    ),
    (
        "sglang.srt.constrained.base_grammar_backend",
        "create_grammar_backend",
        ("server_args", "tokenizer", "vocab_size", "eos_token_ids", "think_end_ids"),
        "calls our init_func as (server_args, tokenizer, vocab_size, eos_token_ids)",
    ),
    (
        "sglang.srt.arg_groups.choices",
        "add_grammar_backend_choices",
        None,
        "widens --grammar-backend's choices (list.extend of GRAMMAR_BACKEND_CHOICES)",
    ),
    (
        "sglang.srt.constrained.base_grammar_backend",
        "BaseGrammarBackend.get_cached_or_future_value",
        ("self", "key", "require_reasoning"),
        "overridden: cache hits, poisoned keys, and our AgreedFuture",
    ),
    (
        "sglang.srt.constrained.base_grammar_backend",
        "BaseGrammarBackend.set_cache",
        ("self", "key", "value"),
        "overridden: a timeout poisons its key for a TTL",
    ),
    (
        "sglang.srt.constrained.base_grammar_backend",
        "BaseGrammarBackend._init_value_dispatch",
        ("self", "key", "require_reasoning"),
        "the inner xgrammar backend's NUL check and dispatch_*, reused for identical grammars",
    ),
    (
        "sglang.srt.constrained.base_grammar_backend",
        "InvalidGrammarObject",
        ("error_message",),
        "what SGLang aborts a request on (its error_message)",
    ),
    (
        "sglang.srt.constrained.xgrammar_backend",
        "XGrammarGrammarBackend",
        ("tokenizer", "vocab_size", "model_eos_token_ids", "any_whitespace", "max_whitespace_cnt"),
        "SGLang's tokenizer info, stop ids and compile calls",
    ),
    (
        "sglang.srt.constrained.xgrammar_backend",
        "XGrammarGrammar",
        (
            "matcher",
            "vocab_size",
            "ctx",
            "override_stop_tokens",
            "key_string",
            "grammar_stats",
        ),
        "subclassed: SGLang's own accept, rollback, fills, jump-forward and retokenization",
    ),
    (
        "sglang.srt.constrained.xgrammar_backend",
        "MAX_ROLLBACK_TOKENS",
        None,
        "the rollback window of SGLang's matchers",
    ),
    (
        "sglang.srt.layers.dp_attention",
        "get_dp_tp_group",
        (),
        "SGLang's grammar sync group (the agreement runs on its cpu_group)",
    ),
    (
        "sglang.srt.runtime_context",
        "get_serving",
        (),
        "constrained_json_* options; reasoning_parser and strict thinking are refused",
    ),
    (
        "sglang.srt.runtime_context",
        "get_parallel",
        (),
        "pp_size (pipeline stages are refused)",
    ),
)


def _check_version() -> None:
    check_version("SGLang", "sglang", SUPPORTED, VERIFIED)


def check_internals() -> list[str]:
    """What is missing or changed among ``INTERNALS`` (empty when all match)."""
    return check(INTERNALS)


def sync_group() -> Any | None:
    """SGLang's grammar sync group as a gloo group, or ``None`` for a group of one."""
    from sglang.srt.layers.dp_attention import get_dp_tp_group

    try:
        group = get_dp_tp_group()
    except RuntimeError:  # no process groups built in this process: nothing to agree with
        logger.info("gramcoord: SGLang built no process groups here; deciding alone")
        return None
    return group.cpu_group if group.world_size > 1 else None


def create_backend(server_args: Any, tokenizer: Any, vocab_size: int, eos_token_ids: Any = None):
    """The ``init_func`` SGLang's ``create_grammar_backend`` calls for ``gramcoord``.

    gramcoord's options come from ``GRAMCOORD_SGLANG_OPTIONS``
    (``backend.options_from_env``): SGLang's launch has no flag for them.

    Raises
    ------
    ValueError
        A setup gramcoord does not support yet, or bad options (SGLang fails
        the launch on it).
    """
    from sglang.srt.runtime_context import get_parallel, get_serving

    from gramcoord.integrations.sglang.backend import SglangBackend, options_from_env

    serving = get_serving()
    # create_grammar_backend wraps only its built-in backends in its reasoner
    # backend, and passes registered ones no think-end ids.
    if serving.reasoning_parser or serving.enable_strict_thinking:
        raise ValueError(
            "--grammar-backend gramcoord does not support --reasoning-parser or "
            "--enable-strict-thinking yet (SGLang gives registered backends no think-end "
            "ids); use --grammar-backend xgrammar for reasoning models"
        )
    # Later stages take stage 0's ready set and would compile on the spot.
    if get_parallel().pp_size > 1:
        raise ValueError(
            "--grammar-backend gramcoord does not support pipeline parallelism "
            "(--pp-size > 1) yet; use --grammar-backend xgrammar there"
        )
    config = options_from_env()
    return SglangBackend(
        tokenizer,
        vocab_size,
        eos_token_ids,
        any_whitespace=not serving.constrained_json_disable_any_whitespace,
        max_whitespace_cnt=serving.constrained_json_max_whitespace_cnt,
        config=config,
        group=sync_group(),
    )


_registered = False


def register() -> None:
    """Register the ``gramcoord`` grammar backend with SGLang; idempotent.

    Raises
    ------
    RuntimeError
        SGLang is not 0.5.x, or an internal used here changed.
    """
    global _registered
    if _registered:
        return
    _check_version()
    problems = check_internals()
    if problems:
        raise RuntimeError("gramcoord cannot register with SGLang: " + "; ".join(problems))
    from sglang.srt.arg_groups.choices import GRAMMAR_BACKEND_CHOICES, add_grammar_backend_choices
    from sglang.srt.constrained.base_grammar_backend import register_grammar_backend

    if NAME not in GRAMMAR_BACKEND_CHOICES:
        add_grammar_backend_choices([NAME])
    register_grammar_backend(NAME, create_backend)
    _registered = True
    logger.info("gramcoord: registered the %r SGLang grammar backend", NAME)
