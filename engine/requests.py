"""A request as the engine runs it, and the record it ends with."""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class EngineRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One request of a workload, as the step loop takes it."""

    request_id: str
    # The structured_outputs mapping; None for an unconstrained request.
    spec: Any = None
    constrained: bool = True
    prompt: str = ""
    max_tokens: int = 256
    # A valid output the synthetic model and the replay drafter follow.
    reference: str | None = None
    # Why the workload record could not be read (the request fails at once).
    error: str | None = None


class ErrorInfo(msgspec.Struct, frozen=True):
    code: str
    message: str


FinishReason = Literal["stop", "grammar_end", "length", "error"]


class OutputRecord(msgspec.Struct, kw_only=True):
    """One line of ``outputs.jsonl``."""

    id: str
    status: Literal["ok", "failed"]
    finish_reason: FinishReason
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    error: ErrorInfo | None = None
    warnings: tuple[str, ...] = ()
    # Admission facts (not part of the comparison with the reference run).
    cache: str = "none"
    compile_ms: float = 0.0
    # The end check of a grammar that does not enforce all of its schema
    # (grammars.end_check): "passed" or "failed"; None when none ran.
    end_check: Literal["passed", "failed"] | None = None
    # The finished output of a json / json_object request parsed as JSON
    # (grammars.end_check.json_check): "passed" or "failed"; None when none ran.
    json_check: Literal["passed", "failed"] | None = None
    # Model forward steps this request took, and steps jump-forward saved.
    model_steps: int = 0
    jump_forward_tokens: int = 0


def failed_record(
    request_id: str, code: str, message: str, warnings: tuple[str, ...] = (), **facts: Any
) -> OutputRecord:
    return OutputRecord(
        id=request_id,
        status="failed",
        finish_reason="error",
        error=ErrorInfo(code, message),
        warnings=warnings,
        **facts,
    )
