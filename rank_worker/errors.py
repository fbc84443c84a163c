"""Stable error and warning codes of one rank's grammar machinery.

Every failed request carries a code string from ``ErrorCode``. The integer
value is what travels in agreement tensors, so it must never be reused or
renumbered: add new codes at the end.
"""

from __future__ import annotations

import re
from enum import IntEnum


class ErrorCode(IntEnum):
    # Spec shape: refused by validate_spec, before any compile, the same on every rank.
    spec_bad_type = 1
    spec_no_kind = 2
    spec_multiple_kinds = 3
    spec_empty_choice = 4
    spec_blank = 5
    spec_json_object_false = 6
    spec_regex_nul = 7
    spec_too_deep = 8
    spec_too_large = 9
    spec_bad_json = 10
    spec_too_many_values = 11
    # JSON Schema features xgrammar would silently ignore or mis-enforce.
    schema_unsupported_feature = 12
    # Compilation.
    grammar_invalid = 20
    grammar_timeout = 21
    grammar_pool_saturated = 22
    grammar_stage_timeout = 23
    grammar_internal = 24
    # Decoding.
    grammar_dead_state = 30
    grammar_terminated = 31
    token_rejected = 32
    # Lifecycle.
    aborted = 40
    # 41 is retired (overflowing the pending window waits, it never fails).
    duplicate_request_id = 42
    bad_request_id = 43
    # A finished output broke the schema its grammar did not fully enforce
    # (the end check, grammars.end_check).
    schema_breach = 50
    # The grammar's shortest sentence needs more tokens than max_tokens.
    grammar_unreachable_end = 51
    # A finished output of a json / json_object request is not JSON
    # (json.loads refuses it; grammars.end_check).
    output_not_json = 52
    # The ranks of an agreement group held different pending requests: every
    # pending request there fails, so no rank admits one another lacks.
    grammar_divergence = 53
    # The TP ranks of a host that fill their own masks (vLLM under
    # external_launcher) filled different rows for a request: it fails on
    # every rank (integrations.vllm.tp_digest).
    tp_mask_mismatch = 54

    @classmethod
    def name_of(cls, value: int) -> str:
        try:
            return cls(value).name
        except ValueError:
            return f"unknown_{value}"


class WarningCode:
    # A $ref that cannot be resolved inside the schema: that part of the
    # output is not constrained.
    unconstrained_ref = "unconstrained_ref"
    # A feature xgrammar ignores, accepted because
    # grammar.reject_ignored_features is off.
    ignored_feature = "ignored_feature"
    # A oneOf whose branches xgrammar cannot prove disjoint: it is enforced
    # as anyOf, so output matching several branches is accepted.
    oneof_as_anyof = "oneof_as_anyof"


class SpecError(ValueError):
    """A structured-output spec was rejected at the boundary.

    Attributes
    ----------
    code:
        Stable ``ErrorCode``.
    message:
        What is wrong and how to fix it.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class GrammarError(RuntimeError):
    """A request failed after validation (compile, decode or lifecycle)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class DeterminismError(RuntimeError):
    """Ranks that must agree sampled different tokens or applied different masks."""

    def __init__(self, message: str, *, ranks: tuple[int, ...], request_id: str, position: int):
        super().__init__(message)
        self.ranks = ranks
        self.request_id = request_id
        self.position = position


# -- native (C++) messages ----------------------------------------------
#
# xgrammar's C++ errors arrive as ``RuntimeError("[02:57:44]
# /project/cpp/json_schema_converter.cc:5088: Cannot find field ...")``:
# a wall-clock time and a build path in front of the text, sometimes nested
# inside another message (a Lark grammar quoting a regex error). The time
# differs between ranks and runs, so it never reaches a request's message.

_TIMESTAMP = r"\[(?:\d{4}-\d{2}-\d{2}[ T])?\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?\]"
_SOURCE_EXT = r"(?:cc|cpp|cxx|c|h|hpp|cu|cuh|py|so)"
# "[time] /dir/file.cc:123: ", anywhere in a line (the location is optional).
_NATIVE_PREFIX = re.compile(
    _TIMESTAMP + r"[ \t]*(?:(?:[^\s:\[\]]*/)?[\w.+-]+\." + _SOURCE_EXT + r"(?::\d+)?:[ \t]*)?"
)
# "Check failed: (cond) is false: " -- the C++ condition means nothing to a user.
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false(?::[ \t]*|(?=\s|$))")
# An absolute path to a source file or library, with its line: keep the name.
_SOURCE_PATH = re.compile(
    r"(?<![\w.])/(?:[^\s/:'\"()\[\]]+/)+([\w.+-]+\." + _SOURCE_EXT + r"(?:\.\d+)*)(?::\d+)?\b"
)
# A pointer: differs between processes.
_HEX_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{8,16}\b")


def clean_native_message(text: str) -> str:
    """A native library's message made the same on every rank and every run.

    Removes log prefixes (``[02:57:44] /project/cpp/file.cc:123: ``) wherever
    they occur, ``Check failed: (...) is false:`` preambles, stack traces,
    directories of source files, pointer values, trailing whitespace and
    blank lines. The meaningful text, including multi-line excerpts such as
    a Lark error's caret line, is kept as it is.

    >>> clean_native_message("[02:57:44] /project/cpp/regex_converter.cc:94: Regex parsing "
    ...                      "error at position 5: The parenthesis is not closed.\\n")
    'Regex parsing error at position 5: The parenthesis is not closed.'
    """
    lines: list[str] = []
    in_trace = False
    for line in text.splitlines():
        if re.fullmatch(r"\s*Stack trace:\s*", line):
            in_trace = True
            continue
        if in_trace and line[:1].isspace():
            continue
        in_trace = False
        line = _NATIVE_PREFIX.sub("", line)
        kept = _CHECK_FAILED.sub("", line)
        # A check without a message keeps its condition: better than nothing.
        line = kept if kept.strip() else line
        line = _SOURCE_PATH.sub(r"\1", line)
        line = _HEX_ADDRESS.sub("0x...", line).rstrip()
        if line.strip():
            lines.append(line)
    return "\n".join(lines).strip()
