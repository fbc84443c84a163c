"""A grammar that fails inside the vLLM engine reaches the client with its code and cause.

vLLM finishes a request whose grammar ``Future`` raised (``GrammarInitError``
from ``backend._refused``: a compile error, a compile past its deadline, a
saturated pool, ranks that diverged, an internal error) as
``FINISHED_ERROR``, with no reason: its OpenAI server answers
``finish_reason == "error"`` with a bare HTTP 500 "Internal server error",
and ``LLM.generate`` returns ``finish_reason="error"`` and nothing more.
Two hooks carry the cause across, one on each side of vLLM's engine-core
boundary (which it crosses as an ``EngineCoreOutput``, serialized between
processes on a server):

- engine core, ``Scheduler.update_from_output``: the ``EngineCoreOutput``
  that finishes such a request gets ``stop_reason`` =
  ``"gramcoord <code>: <message>"`` (a field vLLM leaves empty for
  ``FINISHED_ERROR``), and the engine logs one line per failure naming the
  request and the code;
- front end, ``RequestState.make_request_output``: for the OpenAI server
  (a request with an output queue, ``AsyncLLM``) that output becomes a
  ``GrammarFailure``, a ``GracefulHTTPError``, which vLLM's serving layer
  turns into a JSON error with the status of ``STATUS`` and the message;
  offline (``LLMEngine``) the ``RequestOutput`` keeps
  ``finish_reason="error"`` with the payload as its ``stop_reason``.
"""

from __future__ import annotations

import functools
import logging
import re
from http import HTTPStatus
from typing import Any

from gramcoord.rank_worker.errors import ErrorCode

__all__ = ["PREFIX", "STATUS", "failure_of", "install", "payload", "status_of"]

logger = logging.getLogger(__name__)

PREFIX = "gramcoord "
_PAYLOAD = re.compile(r"gramcoord ([a-z_]+): (.*)", re.S)

# The HTTP status of each code a grammar can fail with inside the engine.
# The client's spec: 400. A schema too costly to compile within the
# server's deadline is the client's to simplify (its key is poisoned for
# grammar.poison_ttl_s, so an identical retry fails at once): 422. The
# server is busy or its ranks disagreed, so a retry may pass: 503. Only a
# fault of gramcoord itself is a 500.
STATUS: dict[str, HTTPStatus] = {
    **{c.name: HTTPStatus.BAD_REQUEST for c in ErrorCode if c.name.startswith("spec_")},
    "schema_unsupported_feature": HTTPStatus.BAD_REQUEST,
    "grammar_invalid": HTTPStatus.BAD_REQUEST,
    "grammar_unreachable_end": HTTPStatus.BAD_REQUEST,
    "duplicate_request_id": HTTPStatus.BAD_REQUEST,
    "bad_request_id": HTTPStatus.BAD_REQUEST,
    "grammar_timeout": HTTPStatus.UNPROCESSABLE_ENTITY,
    "grammar_pool_saturated": HTTPStatus.SERVICE_UNAVAILABLE,
    "grammar_stage_timeout": HTTPStatus.SERVICE_UNAVAILABLE,
    "grammar_divergence": HTTPStatus.SERVICE_UNAVAILABLE,
    "aborted": HTTPStatus.SERVICE_UNAVAILABLE,
    # The output broke a schema its grammar could not enforce whole, and the
    # end check caught it: a retry samples again.
    "schema_breach": HTTPStatus.UNPROCESSABLE_ENTITY,
    "grammar_internal": HTTPStatus.INTERNAL_SERVER_ERROR,
    # The TP ranks filled different masks (tp_digest): a fault of the server.
    "tp_mask_mismatch": HTTPStatus.INTERNAL_SERVER_ERROR,
}


def status_of(code: str) -> HTTPStatus:
    """The HTTP status of ``code`` (500 for a code this table does not know)."""
    return STATUS.get(code, HTTPStatus.INTERNAL_SERVER_ERROR)


def payload(code: str, message: str) -> str:
    """The ``stop_reason`` an engine output carries for a failed grammar."""
    return f"{PREFIX}{code}: {message}"


def parse_payload(stop_reason: Any) -> tuple[str, str] | None:
    """``(code, message)`` of a ``payload``, or ``None`` for any other stop reason."""
    if not isinstance(stop_reason, str) or not stop_reason.startswith(PREFIX):
        return None
    found = _PAYLOAD.fullmatch(stop_reason)
    return (found.group(1), found.group(2)) if found else None


def failure_of(stop_reason: Any) -> Exception | None:
    """The ``GrammarFailure`` of a payload (``None`` for any other stop reason)."""
    parsed = parse_payload(stop_reason)
    if parsed is None:
        return None
    return _failure_class()(*parsed)


@functools.cache
def _failure_class() -> type:
    from vllm.exceptions import GracefulHTTPError

    class GrammarFailure(GracefulHTTPError):
        """A request's grammar failed in the engine: its code, message and HTTP status."""

        def __init__(self, code: str, message: str) -> None:
            super().__init__(f"gramcoord {code}: {message}", status_of(code))
            self.code = code
            self.detail = message

    return GrammarFailure


def _grammar_errors(scheduler: Any) -> dict[str, Any]:
    """The requests this step finishes for a failed gramcoord grammar, and why."""
    from gramcoord.integrations.vllm.backend import GrammarInitError, VllmBackend

    backend = scheduler.structured_output_manager.backend
    digests = backend.digests if isinstance(backend, VllmBackend) else None
    found = {}
    for rid in scheduler.grammar_compile_error_reqs:
        request = scheduler.requests.get(rid)
        sor = request.structured_output_request if request is not None else None
        error = getattr(sor, "_grammar", None)
        if isinstance(error, GrammarInitError):
            found[rid] = error
        elif digests is not None and rid in digests.failed:
            code, message = digests.failed[rid]
            found[rid] = GrammarInitError(rid, code.name, message)
    return found


def _wrap_scheduler() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import FinishReason

    original = Scheduler.update_from_output

    @functools.wraps(original)
    def update_from_output(self, scheduler_output, model_runner_output):
        failed = _grammar_errors(self) if self.grammar_compile_error_reqs else {}
        outputs = original(self, scheduler_output, model_runner_output)
        breaches = _take_breaches(self)
        if breaches:
            _fail_breaches(outputs, breaches, FinishReason)
        if not failed:
            return outputs
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                # A request failed while it ran (a TP mask mismatch) has this
                # step's token output before its FINISHED_ERROR one.
                if out.finish_reason != FinishReason.ERROR:
                    continue
                error = failed.pop(out.request_id, None)
                if error is None:
                    continue
                out.stop_reason = payload(error.code, error.message)
                logger.warning(
                    "gramcoord: request %s failed: %s: %s",
                    out.request_id,
                    error.code,
                    error.message,
                )
        return outputs

    Scheduler.update_from_output = update_from_output


def _take_breaches(scheduler: Any) -> dict[str, str]:
    from gramcoord.integrations.vllm.backend import VllmBackend

    backend = scheduler.structured_output_manager.backend
    return backend.take_breaches() if isinstance(backend, VllmBackend) else {}


def _fail_breaches(outputs: Any, breaches: dict[str, str], finish: Any) -> None:
    """The outputs that finish a request whose text broke its schema become
    ``schema_breach`` failures: never delivered as if valid.

    A breach is found when the matcher terminates, which happens on the
    stop token that finishes the request, in the step whose outputs these
    are (a request freed otherwise, an abort, has no output here: its
    breach is dropped)."""
    for engine_outputs in outputs.values():
        for out in engine_outputs.outputs:
            why = breaches.get(out.request_id)
            if why is None or out.finish_reason is None or out.finish_reason == finish.ERROR:
                continue
            out.finish_reason = finish.ERROR
            out.stop_reason = payload(ErrorCode.schema_breach.name, why)
            logger.warning(
                "gramcoord: request %s failed: %s: %s",
                out.request_id,
                ErrorCode.schema_breach.name,
                why,
            )


def _wrap_output() -> None:
    from vllm.v1.engine import FinishReason
    from vllm.v1.engine.output_processor import RequestState

    original = RequestState.make_request_output

    @functools.wraps(original)
    def make_request_output(
        self, new_token_ids, pooling_output, finish_reason, stop_reason, *a, **kw
    ):
        output = original(self, new_token_ids, pooling_output, finish_reason, stop_reason, *a, **kw)
        if finish_reason != FinishReason.ERROR or self.queue is None:
            return output  # offline: the RequestOutput carries the payload as stop_reason
        # AsyncLLM puts what this returns in the request's queue, and raises
        # an exception found there from generate(): the serving layer maps it.
        return failure_of(stop_reason) or output

    RequestState.make_request_output = make_request_output


def install() -> None:
    """Install both hooks (``plugin.register`` calls it once per process)."""
    _wrap_scheduler()
    _wrap_output()
