"""Grammar failures inside the in-process vLLM engine reach the caller with code and cause.

The engine is the shared gramcoord one (``conftest.GRAMCOORD_CONFIG``): its
``faults`` make a spec containing ``FAULT_BREAK`` fail to compile and one
containing ``FAULT_HANG`` hang in its compile. Offline, ``LLM.generate``
returns such a request with ``finish_reason="error"`` and ``stop_reason``
``"gramcoord <code>: <message>"``; the other requests of the same call run
on; the engine logs one line naming the request and the code. A bad
``additional_config["gramcoord"]`` stops ``LLM(...)`` before any engine
starts, naming the field. (The OpenAI server's statuses: ``test_serve.py``.)
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

pytest.importorskip("vllm")

from gramcoord.benchmarks._vllm_common import ENGINE_KW
from tests.integrations.vllm.conftest import FAULT_BREAK, FAULT_HANG, engine_backend

pytestmark = pytest.mark.timeout(600)

PROMPT = "Give JSON:"
LOGGER = "gramcoord.integrations.vllm.failures"


def _params(schema: Any, **kw: Any) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    kw.setdefault("max_tokens", 4)
    return SamplingParams(
        temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema), **kw
    )


def _marked(mark: str, n: int = 0) -> dict:
    return {"type": "object", "properties": {f"{mark}-{n}": {"type": "integer"}}}


def _failure_lines(caplog, code: str) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    return [line for line in lines if f"failed: {code}: " in line]


@pytest.fixture
def gramcoord_llm(engines) -> Any:
    llm = engines.get("gramcoord")
    llm.generate([PROMPT], _params({"type": "integer"}, max_tokens=2), use_tqdm=False)
    return llm


def test_a_compile_error_names_its_code_and_message(gramcoord_llm, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        bad, good = gramcoord_llm.generate(
            [PROMPT, PROMPT],
            [_params(_marked(FAULT_BREAK)), _params({"type": "integer"})],
            use_tqdm=False,
        )
    out = bad.outputs[0]
    assert out.finish_reason == "error" and out.token_ids == []
    assert out.stop_reason == (
        "gramcoord grammar_invalid: RuntimeError: fault injected on rank 0: faults.compile_error"
    )
    assert good.outputs[0].finish_reason in ("stop", "length")
    (line,) = _failure_lines(caplog, "grammar_invalid")
    assert line.startswith(f"gramcoord: request {bad.request_id}")
    assert engine_backend(gramcoord_llm).num_live == 0


def test_a_compile_past_its_deadline_is_grammar_timeout(gramcoord_llm, caplog) -> None:
    service = engine_backend(gramcoord_llm).grammars.leader._manager.service
    before, service.timeout_s = service.timeout_s, 1.0  # the engine's is COMPILE_DEADLINE's
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            (hung,) = gramcoord_llm.generate(
                [PROMPT], [_params(_marked(FAULT_HANG))], use_tqdm=False
            )
            # The key is poisoned: the same spec fails at once, the same way.
            (again,) = gramcoord_llm.generate(
                [PROMPT], [_params(_marked(FAULT_HANG))], use_tqdm=False
            )
    finally:
        service.timeout_s = before
    for got in (hung, again):
        out = got.outputs[0]
        assert out.finish_reason == "error", out
        assert out.stop_reason.startswith("gramcoord grammar_timeout: "), out.stop_reason
    assert "compile_timeout_s=1s" in hung.outputs[0].stop_reason
    lines = _failure_lines(caplog, "grammar_timeout")
    assert len(lines) == 2 and lines[0].startswith(f"gramcoord: request {hung.request_id}")


def test_a_bad_additional_config_stops_the_engine_at_start(tiny_model) -> None:
    from gramcoord.integrations.vllm.options import OptionsError
    from gramcoord.integrations.vllm.plugin import register

    register()
    from vllm import LLM

    with pytest.raises(OptionsError) as info:
        LLM(
            str(tiny_model),
            structured_outputs_config={"backend": "gramcoord"},
            additional_config={"gramcoord": {"grammar": {"compile_timeout_s": "soon"}}},
            **ENGINE_KW,
        )
    assert info.value.field == "gramcoord.grammar.compile_timeout_s"
    assert "Expected `float`, got `str`" in str(info.value)
