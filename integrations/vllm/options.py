"""``additional_config["gramcoord"]`` under vLLM: parsed, and checked when the engine starts.

vLLM passes ``--additional-config`` (``LLM(additional_config=...)``) through
untouched, as a ``dict``; nothing of vLLM reads our section. Left alone, a
mistake in it would surface only when the backend is built, at the first
structured request, as a failure of every such request behind a server
whose ``/health`` says 200. ``install()`` wraps
``EngineArgs.create_engine_config``, which the offline ``LLM(...)``, the
OpenAI server and ``vllm serve`` all call before any engine process
starts: a bad section stops the start there, with the field's path and
what is wrong with it.

The section has three parts, each a gramcoord config type: ``grammar``
(only the engine-side options below; spec rules stay the defaults vLLM's
front end validates with), ``faults`` and ``distributed``.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

import msgspec

from gramcoord.coordinator.config import DistributedConfig
from gramcoord.rank_worker.config import FaultsConfig, GrammarConfig

__all__ = [
    "ENGINE_OPTIONS",
    "GramcoordOptions",
    "OptionsError",
    "install",
    "parse",
    "vllm_grammar_config",
]

# Options of additional_config["gramcoord"]["grammar"] that do not change
# which specs are accepted (the front end validates with the defaults).
ENGINE_OPTIONS = frozenset(
    {
        "compile_timeout_s",
        "compile_wall_timeout_s",
        "compile_nice",
        "num_compile_workers",
        "num_stuck_compiles",
        "poison_ttl_s",
        "cache_limit_mb",
        "num_cache_entries",
        "num_poison_entries",
        "max_pending",
        "store",
    }
)
SECTIONS = ("grammar", "faults", "distributed")
NAME_KEY = "gramcoord"
_WHY_NOT = {
    "reject_ignored_features": "always false under vLLM: a schema the grammar cannot "
    "enforce whole is served, and its finished output is checked against the schema "
    "(a breach fails with schema_breach)",
    "any_whitespace": "vLLM's --structured-outputs-config disable_any_whitespace sets it",
    "options_at": "set by the vLLM plugin: messages name --additional-config fields",
    "compile_mode": "always async under vLLM (the agreement keeps TP ranks in step)",
}


class OptionsError(ValueError):
    """``additional_config["gramcoord"]`` is invalid; ``field`` is the path of the bad field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"--additional-config {field}: {problem}")
        self.field = field
        self.problem = problem


class GramcoordOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The parsed section: the engine's ``GrammarConfig``, faults and distributed options."""

    grammar: GrammarConfig
    faults: FaultsConfig
    distributed: DistributedConfig


def _convert(value: Any, typ: type, where: str) -> Any:
    """``msgspec.convert``, its error raised as an ``OptionsError`` naming the field."""
    try:
        return msgspec.convert(value, typ)
    except msgspec.ValidationError as exc:
        text, _, path = str(exc).partition(" - at `")
        field = where + path.rstrip("`").removeprefix("$") if path else where
        unknown = re.fullmatch(r"Object contains unknown field `(.+)`", text)
        if unknown:  # name the field itself, not the object holding it
            field, text = f"{field}.{unknown.group(1)}", "unknown field"
        raise OptionsError(field, text) from None


def vllm_grammar_config(disable_any_whitespace: bool, options: Any = None) -> GrammarConfig:
    """The ``GrammarConfig`` for vLLM: vLLM's whitespace rule, a compile pool of 2+
    whose threads run at nice +10, refusals worded for vLLM.

    ``options`` (``additional_config["gramcoord"]["grammar"]``) may set only
    ``ENGINE_OPTIONS``; spec rules stay the defaults the front end checks.

    Raises
    ------
    OptionsError
        ``options`` is not an object, names another field, or a value is invalid.
    """
    where = "gramcoord.grammar"
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise OptionsError(where, f"expected an object, got {type(options).__name__}")
    for name in sorted(options):
        if name not in ENGINE_OPTIONS:
            why = _WHY_NOT.get(name) or (
                f"not an option of the vLLM plugin; it may set only {', '.join(sorted(ENGINE_OPTIONS))}"
                if name in GrammarConfig.__struct_fields__
                else f"unknown field; the vLLM plugin may set {', '.join(sorted(ENGINE_OPTIONS))}"
            )
            raise OptionsError(f"{where}.{name}", why)
    options = dict(options)
    # One slow compile must not queue the fast ones behind it, nor starve
    # the engine loop of CPU (compile threads yield to the loop).
    options.setdefault("num_compile_workers", max(2, (os.cpu_count() or 2) // 2))
    options.setdefault("compile_nice", 10)
    # What xgrammar would not enforce is served, and the finished output is
    # checked against the schema in the engine (backend.VllmGrammar sees
    # every token it accepts; failures.py turns a breach into an error).
    fixed = {
        "compile_mode": "async",
        "any_whitespace": not disable_any_whitespace,
        "reject_ignored_features": False,
        "options_at": f"--additional-config {NAME_KEY}.grammar.",
    }
    return _convert({**options, **fixed}, GrammarConfig, where)


@functools.cache
def front_end_config(disable_any_whitespace: bool) -> GrammarConfig:
    """The config vLLM's front end validates every request with (made once per option)."""
    return vllm_grammar_config(disable_any_whitespace)


def parse(section: Any, disable_any_whitespace: bool = False) -> GramcoordOptions:
    """``additional_config["gramcoord"]`` (``None``: absent), parsed and checked.

    Raises
    ------
    OptionsError
        Naming the first bad field, as ``gramcoord.grammar.compile_timeout_s``.
    """
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise OptionsError("gramcoord", f"expected an object, got {type(section).__name__}")
    for name in sorted(section):
        if name not in SECTIONS:
            raise OptionsError(f"gramcoord.{name}", f"unknown field; use {', '.join(SECTIONS)}")
    return GramcoordOptions(
        grammar=vllm_grammar_config(disable_any_whitespace, section.get("grammar")),
        faults=_convert(section.get("faults", {}), FaultsConfig, "gramcoord.faults"),
        distributed=_convert(
            section.get("distributed", {}), DistributedConfig, "gramcoord.distributed"
        ),
    )


def check_engine_config(config: Any) -> None:
    """Refuse a bad ``additional_config["gramcoord"]`` of a built ``VllmConfig``."""
    extra = getattr(config, "additional_config", None) or {}
    so = getattr(config, "structured_outputs_config", None)
    if NAME_KEY in extra or getattr(so, "backend", None) == NAME_KEY:
        parse(extra.get(NAME_KEY), bool(getattr(so, "disable_any_whitespace", False)))


def vocab_name(vllm_config: Any) -> str:
    """The vocabulary's name in every grammar key of this engine (and its spec store)."""
    model = vllm_config.model_config
    return f"vllm:{model.tokenizer}:{model.get_vocab_size()}"


def install(on_config: Any = None) -> None:
    """Wrap ``EngineArgs.create_engine_config``: the section is checked before an engine
    starts; then ``on_config(config)``, in the process that made the config."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        check_engine_config(config)
        if on_config is not None:
            on_config(config)
        return config

    EngineArgs.create_engine_config = create_engine_config
