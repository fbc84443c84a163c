"""What ``GenerateSession`` keeps per prepared request, and what it reports for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import msgspec

from gramcoord.rank_worker.grammars.outcome import Outcome
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer

if TYPE_CHECKING:
    from gramcoord.integrations.hf.processor import GrammarLogitsProcessor

FinishReason = Literal["grammar_end", "stop", "length", "error", "not_generated"]


class GenerationResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one request came to after ``generate``.

    Attributes
    ----------
    request_id:
        The request.
    status:
        ``"ok"``: admitted and every generated token was accepted by the
        grammar. ``"failed"``: admission failed, or the grammar refused a
        token (``code`` says which).
    finish_reason:
        ``"grammar_end"``: the grammar accepted a stop token (the output is
        complete); ``"stop"``: the row produced a host stop token the
        grammar does not end on; ``"length"``: generation stopped first
        (``max_new_tokens`` or another stopping criterion); ``"error"``:
        failed; ``"not_generated"``: admitted but no processor row ran it.
    complete:
        ``finish_reason == "grammar_end"``.
    token_ids:
        Tokens the grammar accepted, the final stop token included.
    text:
        ``token_ids`` decoded without stop tokens (invalid UTF-8 replaced).
    code, message:
        The error code and message of a failed request (``None`` / ``""``).
    cache:
        How admission went: ``miss``, ``hit``, ``joined``, ``poisoned``,
        ``none``.
    compile_ms:
        Compile time of a request that compiled its own grammar.
    warnings:
        Warning codes of the spec (e.g. ``unconstrained_ref``).
    """

    request_id: str
    status: Literal["ok", "failed"]
    finish_reason: FinishReason
    complete: bool
    token_ids: tuple[int, ...]
    text: str
    code: str | None = None
    message: str = ""
    cache: str = "none"
    compile_ms: float = 0.0
    warnings: tuple[str, ...] = ()


@dataclass(eq=False)
class Record:
    """One prepared request: its admission and what generation did with it."""

    outcome: Outcome
    token_ids: list[int] = field(default_factory=list)
    reason: FinishReason | None = None
    error: tuple[str, str] | None = None
    generated: bool = False
    processor: GrammarLogitsProcessor | None = None

    def result(self, tokenizer: Tokenizer) -> GenerationResult:
        """The request's ``GenerationResult``, its text decoded with ``tokenizer``."""
        o = self.outcome
        if o.status != "admitted":
            code = o.code or "not_admitted"
            message = o.message or f"request was {o.status} when generation ended"
            status, reason, tokens = "failed", "error", ()
        elif self.error is not None:
            (code, message), status, reason = self.error, "failed", "error"
            tokens = tuple(self.token_ids)
        else:
            code, message, status = None, "", "ok"
            reason = self.reason or ("length" if self.generated else "not_generated")
            tokens = tuple(self.token_ids)
        return GenerationResult(
            request_id=o.request_id,
            status=status,
            finish_reason=reason,
            complete=reason == "grammar_end",
            token_ids=tokens,
            text=tokenizer.decode(list(tokens)),
            code=code,
            message=message,
            cache=o.cache,
            compile_ms=o.compile_ms,
            warnings=o.warnings,
        )
