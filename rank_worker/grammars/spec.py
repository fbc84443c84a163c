"""Structured-output specs: the request-facing type, validation and keys.

``StructuredOutputSpec`` uses vLLM's field names. ``admit`` turns one into
a ``GrammarSpec`` (a normalized, hashable description of exactly what will
be compiled, with its grammar key) in one forward sequence of passes:
parse the request, make the text (for a JSON schema: ``schema``'s
canonical form, one walk, and the verdict), key it, and with a token
budget bound it (``shortest``). ``GrammarManager.add`` calls ``admit``;
hosts that only validate call ``validate_spec``. Every rejection is a
``SpecError`` with a stable code; nothing here raises anything else for
bad input.

The passes up to the key run once per spec text per process: a spec given
as text, or as an object whose JSON text stands for it exactly (a
workload's or a ``GenerateSession``'s schema), is remembered with
its verdict (``_Verdicts``), so a cache hit, and the second validation of a
request that vLLM validates in its front end and again in its engine core,
cost a lookup.

The key is a blake2b-128 digest of ``kind``, the canonical text, the compile
options and the vocabulary name. It is the same on every rank and every run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple

import msgspec

from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.errors import ErrorCode, SpecError
from gramcoord.rank_worker.grammars.schema import (
    END_CHECKED,
    MAX_DEPTH,
    MAX_VALUES,
    canonical_json,
    schema_text,
    tag_schemas,
)
from gramcoord.rank_worker.grammars.schema_tree import SchemaTree
from gramcoord.rank_worker.grammars.shortest import min_output_bytes, unreachable_end

GrammarKind = Literal["json", "regex", "choice", "ebnf", "lark", "json_object", "structural_tag"]
_KIND_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a request asks for; exactly one of the first six fields is set."""

    # A JSON Schema: an object, a boolean, or its JSON text.
    json: Any = None
    # A regular expression the whole output must match.
    regex: str | None = None
    # The output must be exactly one of these strings.
    choice: list[str] | None = None
    # An EBNF (GBNF) or Lark grammar; see ``grammar_syntax``.
    grammar: str | None = None
    # Any JSON object; only ``true`` is meaningful.
    json_object: bool | None = None
    # An xgrammar structural tag: an object or its JSON text.
    structural_tag: Any = None
    # "auto" treats a grammar containing "::=" as EBNF, else Lark.
    grammar_syntax: Literal["auto", "ebnf", "lark"] = "auto"
    # Override grammar.any_whitespace for this request.
    any_whitespace: bool | None = None
    # Override grammar.strict_mode for this request.
    strict_mode: bool | None = None
    # vLLM spellings, accepted so vLLM-style records load as they are.
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    backend: str | None = None
    disable_fallback: bool | None = None
    whitespace_pattern: str | None = None


class GrammarSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A validated spec: exactly what will be compiled, and its key."""

    kind: GrammarKind
    # Canonical text handed to the compiler (JSON with canonical key order
    # for json/structural_tag, the choice list as JSON, raw text otherwise).
    text: str
    any_whitespace: bool
    strict_mode: bool
    # blake2b-128 digest; identical on every rank for the same spec.
    key: bytes
    warnings: tuple[str, ...] = ()
    # The grammar does not enforce all of the schema (an ignored feature
    # accepted with a warning, or a oneOf enforced as anyOf): the finished
    # output is validated against ``text`` before it is returned
    # (``grammars.end_check``).
    end_check: bool = False

    @property
    def needs_full_vocab(self) -> bool:
        """Lark and structural tags may emit special tokens such as <tool_call>."""
        return self.kind in ("lark", "structural_tag")


def _text_depth(text: str) -> int:
    """Bracket nesting of a regex or grammar, skipping escapes and classes."""
    depth = best = 0
    escaped = in_class = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
            best = max(best, depth)
        elif ch == ")":
            depth = max(0, depth - 1)
    return best


def _as_spec(raw: Any) -> StructuredOutputSpec:
    if isinstance(raw, StructuredOutputSpec):
        return raw
    try:
        if isinstance(raw, bytes | str):
            return msgspec.json.decode(raw, type=StructuredOutputSpec)
        return msgspec.convert(raw, StructuredOutputSpec)
    except msgspec.ValidationError as exc:
        raise SpecError(ErrorCode.spec_bad_type, f"structured_outputs: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise SpecError(ErrorCode.spec_bad_json, f"structured_outputs is not JSON: {exc}") from exc


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _load_json_value(value: Any, field: str, config: GrammarConfig) -> Any:
    if isinstance(value, str):
        if not value.strip():
            raise SpecError(ErrorCode.spec_blank, f"{field} is blank; pass a JSON value")
        # Cheap size check before any parsing: a huge text is never walked.
        _check_size(value, config, field)
        try:
            return json.loads(value, parse_constant=_reject_constant)
        except RecursionError as exc:
            raise SpecError(
                ErrorCode.spec_too_deep, f"{field} nests deeper than {MAX_DEPTH}"
            ) from exc
        except ValueError as exc:
            raise SpecError(ErrorCode.spec_bad_json, f"{field} is not valid JSON: {exc}") from exc
    return value


def _check_size(text: str, config: GrammarConfig, field: str) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > config.max_spec_bytes:
        raise SpecError(
            ErrorCode.spec_too_large,
            f"{field} is {size} bytes; the limit is grammar.max_spec_bytes={config.max_spec_bytes}",
        )


def _json_schema(value: Any, config: GrammarConfig, strict_mode: bool):
    """Parse and size a JSON schema, then hand it to ``schema`` for its passes."""
    schema = _load_json_value(value, "json", config)
    if not isinstance(value, str):
        # A schema given as an object is sized before the walk too: a hostile
        # 5 MB object fails in one C-speed dump, not after seconds of lint.
        _check_size(canonical_json(schema), config, "json")
    if schema is True or schema == {}:
        schema = {}
    elif schema is False:
        raise SpecError(ErrorCode.spec_bad_json, "json schema `false` accepts nothing")
    if not isinstance(schema, dict):
        raise SpecError(
            ErrorCode.spec_bad_json,
            f"json must be a JSON Schema object or boolean, not {type(schema).__name__}",
        )
    text, warnings, tree = schema_text(schema, config, strict_mode)
    _check_size(text, config, "json")
    return text, warnings, tree


def _pick_kind(spec: StructuredOutputSpec) -> str:
    given = [f for f in _KIND_FIELDS if getattr(spec, f) is not None]
    if not given:
        raise SpecError(ErrorCode.spec_no_kind, f"set exactly one of {', '.join(_KIND_FIELDS)}")
    if len(given) > 1:
        raise SpecError(
            ErrorCode.spec_multiple_kinds,
            f"set exactly one of {', '.join(_KIND_FIELDS)}; got {', '.join(given)}",
        )
    return given[0]


class _Text(NamedTuple):
    """What a spec compiles: its kind and text, the warnings on it, and a JSON schema's tree."""

    kind: str
    text: str
    warnings: list[str]
    tree: SchemaTree | None = None


def _kind_and_text(
    spec: StructuredOutputSpec, field: str, config: GrammarConfig, strict: bool
) -> _Text:
    if field == "json":
        return _Text("json", *_json_schema(spec.json, config, strict))
    if field == "json_object":
        if spec.json_object is not True:
            raise SpecError(ErrorCode.spec_json_object_false, "json_object must be true")
        return _Text("json_object", "", [])
    if field == "choice":
        choice = spec.choice or []
        if not choice:
            raise SpecError(ErrorCode.spec_empty_choice, "choice needs at least one string")
        if len(choice) > MAX_VALUES:
            raise SpecError(
                ErrorCode.spec_too_many_values,
                f"choice has {len(choice)} options; the limit is {MAX_VALUES}",
            )
        text = canonical_json(choice)
        _check_size(text, config, "choice")
        return _Text("choice", text, [])
    if field == "structural_tag":
        tag = _load_json_value(spec.structural_tag, "structural_tag", config)
        if not isinstance(tag, dict) or not tag:
            raise SpecError(ErrorCode.spec_blank, "structural_tag must be a non-empty JSON object")
        # Embedded schemas compile in strict mode, rewritten as json specs are.
        tag, warnings = tag_schemas(tag)
        # NOTE: key order is kept, not sorted: a structural tag embeds JSON
        # schemas whose `properties` order is the order xgrammar emits.
        text = canonical_json(tag)
        _check_size(text, config, "structural_tag")
        return _Text("structural_tag", text, warnings)
    text = spec.regex if field == "regex" else spec.grammar
    assert text is not None
    _check_size(text, config, field)
    if not text.strip():
        raise SpecError(ErrorCode.spec_blank, f"{field} is blank")
    if field == "regex" and "\x00" in text:
        raise SpecError(ErrorCode.spec_regex_nul, "regex contains a NUL character")
    depth = _text_depth(text)
    if depth > MAX_DEPTH:
        raise SpecError(
            ErrorCode.spec_too_deep, f"{field} nests {depth} groups; the limit is {MAX_DEPTH}"
        )
    if field == "regex":
        return _Text("regex", text, [])
    syntax = spec.grammar_syntax
    if syntax == "auto":
        syntax = "ebnf" if "::=" in text else "lark"
    return _Text(syntax, text, [])


def _check_unicode(text: str, field: str) -> None:
    """Reject lone surrogates: they are not Unicode, and the compiler needs UTF-8.

    A Python host that decoded a client's bytes with ``surrogateescape``
    hands invalid UTF-8 over as lone surrogates (``\\udcff`` for byte 0xff),
    and JSON text may spell one as an escape (``"\\ud800"``). Caught here, the
    request fails with a code at admission on every path, instead of a
    ``UnicodeEncodeError`` inside the compile.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SpecError(
            ErrorCode.spec_bad_json,
            f"{field} holds a lone surrogate U+{ord(text[exc.start]):04X} at character "
            f"{exc.start} (invalid UTF-8 or an unpaired \\u escape); send valid Unicode",
        ) from exc


def grammar_key(kind: str, text: str, any_whitespace: bool, strict_mode: bool, vocab: str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in (kind, text, f"ws={int(any_whitespace)}", f"strict={int(strict_mode)}", vocab):
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.digest()


class _Held:
    """A remembered verdict: the admitted text, or a refusal's code and message."""

    __slots__ = ("made", "min_bytes", "refused", "size")

    def __init__(self, made: _Text | None, refused: tuple[ErrorCode, str] | None, size: int):
        self.made = made
        self.refused = refused
        # The bound's lower bound on output bytes, once a budget asked for it.
        self.min_bytes: int | None = None
        self.size = size


def _object_text(value: Any) -> bytes | None:
    """The JSON text of an object-valued field when it stands for the value
    exactly, else ``None``.

    Exactly: decoding the text gives back an equal value. A value the text
    would change fails this (``{1: ...}`` whose text is ``{"1": ...}``, a
    tuple, NaN, bytes, an odd type), and values with one text are then of
    one JSON type at every node (``1`` and ``1.0`` have two texts). About
    0.2 ms for a 500-property schema, against about 11 ms of validation.
    """
    try:
        text = msgspec.json.encode(value)
        return text if msgspec.json.decode(text) == value else None
    except (TypeError, ValueError, OverflowError, RecursionError, msgspec.MsgspecError):
        return None


class _Verdicts:
    """The verdicts of the specs this process validated, by spec text; bounded LRU.

    A spec is remembered when every field is text, a flag, a list of
    strings, or an object whose JSON text stands for it exactly
    (``_object_text``: gramcoord's workloads and the HF integration hand
    schemas over as objects): its fields are the key. Any other spec is
    validated each time. The grammar config and the strictness are part of
    the key; the verdict is a function of them. Bounded by the characters
    of spec text held (``MAX_CHARS``), oldest first out.
    """

    MAX_CHARS = 8 << 20
    # A spec larger than this share of the bound is never held.
    MAX_SHARE = 8

    def __init__(self) -> None:
        self._held: OrderedDict[tuple, _Held] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    @staticmethod
    def key(spec: StructuredOutputSpec, config: GrammarConfig, strict: bool) -> tuple | None:
        values = []
        for name in spec.__struct_fields__:
            value = getattr(spec, name)
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                value = tuple(value)  # a choice
            elif isinstance(value, dict | list):
                value = _object_text(value)  # bytes: never equal to a text field
                if value is None:
                    return None
            elif not (value is None or isinstance(value, str | bool)):
                return None
            values.append(value)
        return (tuple(values), strict, config)

    def get(self, key: tuple) -> _Held | None:
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                self._held.move_to_end(key)
            return held

    def put(self, key: tuple, held: _Held) -> None:
        if held.size > self.MAX_CHARS // self.MAX_SHARE:
            return
        with self._lock:
            if key in self._held:
                return
            self._held[key] = held
            self._chars += held.size
            while self._chars > self.MAX_CHARS:
                _, old = self._held.popitem(last=False)
                self._chars -= old.size

    def clear(self) -> None:
        with self._lock:
            self._held.clear()
            self._chars = 0


_verdicts = _Verdicts()


def _spec_size(key: tuple) -> int:
    """Characters of a held spec's key (what holding its verdict costs, roughly)."""
    size = 0
    for value in key[0]:
        if isinstance(value, str | bytes):
            size += len(value)
        elif isinstance(value, tuple):
            size += sum(len(v) for v in value)
    return size


def _validated_text(
    spec: StructuredOutputSpec, config: GrammarConfig, strict: bool
) -> tuple[_Text, _Held | None]:
    """The kind and text a parsed spec compiles (passes 1-2 of ``admit``), remembered by text."""
    key = _verdicts.key(spec, config, strict)
    held = _verdicts.get(key) if key is not None else None
    if held is None:
        try:
            made = _checked_text(spec, config, strict)
        except SpecError as exc:
            if key is not None:
                _verdicts.put(key, _Held(None, (exc.code, exc.message), _spec_size(key)))
            raise
        if key is None:
            return made, None
        held = _Held(made._replace(warnings=tuple(made.warnings)), None, _spec_size(key))
        _verdicts.put(key, held)
    if held.refused is not None:
        raise SpecError(*held.refused)
    assert held.made is not None
    return held.made._replace(warnings=list(held.made.warnings)), held


@contextlib.contextmanager
def _the_specs_fault() -> Iterator[None]:
    """Errors of a malformed spec become ``SpecError``: the spec's fault, never the rank's."""
    try:
        yield
    except RecursionError as exc:
        raise SpecError(ErrorCode.spec_too_deep, "spec nests too deeply to process") from exc
    except (TypeError, ValueError, OverflowError) as exc:
        if isinstance(exc, SpecError):
            raise
        # Backstop: malformed values inside a spec (NaN, non-string keys,
        # odd types).
        raise SpecError(ErrorCode.spec_bad_json, f"malformed spec: {exc}") from exc


def _checked_text(spec: StructuredOutputSpec, config: GrammarConfig, strict: bool) -> _Text:
    field = _pick_kind(spec)
    with _the_specs_fault():
        made = _kind_and_text(spec, field, config, strict)
        _check_unicode(made.text, field)
    return made


class TokenBudget(NamedTuple):
    """A request's token budget, for the unreachable-end bound (``shortest``)."""

    max_tokens: int
    # The vocabulary's longest token, in bytes.
    max_token_bytes: int


class Admission(NamedTuple):
    """A validated spec, and whether it can end within the request's budget."""

    spec: GrammarSpec
    # Why no output fits in the budget (``grammar_unreachable_end``); None
    # when one may, or when no budget was given.
    unreachable_end: str | None = None


def admit(
    raw: Any, config: GrammarConfig, *, vocab: str = "", budget: TokenBudget | None = None
) -> Admission:
    """Validate a spec, key it and, given a budget, bound it: one pass after another.

    1. **parse** the request: its kind, its options, its value (sized);
    2. **the text**: for a JSON schema, ``schema.schema_text`` (canonical
       form, one walk that lints and follows the converter, the verdict);
       for the other kinds, their own rules;
    3. **the key** of the text and the compile options;
    4. **the bound**, with ``budget``: the fewest tokens any output needs
       (``shortest.unreachable_end``).

    Parameters
    ----------
    raw:
        A ``StructuredOutputSpec``, a mapping with its fields (a workload's
        ``structured_outputs``), or its JSON text.
    config:
        Limits and defaults (``max_spec_bytes``, ``any_whitespace``, ...).
    vocab:
        Vocabulary name, part of the key because compiled grammars are
        vocabulary-specific.
    budget:
        The request's ``max_tokens`` and the vocabulary's longest token;
        ``None`` skips the bound.

    Returns
    -------
    Admission

    Raises
    ------
    SpecError
        The spec is malformed, hostile, or uses features that would not be
        enforced. ``code`` is stable; ``message`` says how to fix it.
    """
    with _the_specs_fault():
        spec = _as_spec(raw)
    strict = config.strict_mode
    if spec.disable_additional_properties is not None:
        strict = spec.disable_additional_properties
    if spec.strict_mode is not None:
        strict = spec.strict_mode
    made, held = _validated_text(spec, config, strict)
    any_ws = config.any_whitespace
    if spec.disable_any_whitespace is not None:
        any_ws = not spec.disable_any_whitespace
    if spec.any_whitespace is not None:
        any_ws = spec.any_whitespace
    kind, text, warnings = made.kind, made.text, made.warnings
    # Options only matter for JSON; normalizing them elsewhere keeps one key
    # per grammar.
    if kind not in ("json", "json_object"):
        any_ws, strict = True, True
    gspec = GrammarSpec(
        kind=kind,
        text=text,
        any_whitespace=any_ws,
        strict_mode=strict,
        key=grammar_key(kind, text, any_ws, strict, vocab),
        warnings=tuple(warnings),
        end_check=kind == "json" and any(w.startswith(END_CHECKED) for w in warnings),
    )
    if budget is None:
        return Admission(gspec)
    min_bytes = held.min_bytes if held is not None else None
    if min_bytes is None:
        min_bytes = min_output_bytes(kind, text, made.tree)
        if held is not None:
            held.min_bytes = min_bytes
    why = unreachable_end(min_bytes, budget.max_tokens, budget.max_token_bytes)
    return Admission(gspec, why)


def validate_spec(raw: Any, config: GrammarConfig, *, vocab: str = "") -> GrammarSpec:
    """``admit`` without a budget: the validated spec and its key (see ``admit``)."""
    return admit(raw, config, vocab=vocab).spec
