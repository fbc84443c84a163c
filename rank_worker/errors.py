"""Stable error and warning codes of one rank's grammar machinery.

Every failed request carries a code string from ``ErrorCode``. The integer
value is what travels in agreement tensors, so it must never be reused or
renumbered: add new codes at the end.
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    # Spec shape (DESIGN section 2).
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
