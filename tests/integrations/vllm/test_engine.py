"""gramcoord inside the real vLLM 0.32 engine, one process: outputs, refusals, state."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.integrations.vllm.conftest import engine_backend, fast_schemas

pytestmark = pytest.mark.timeout(600)

PROMPT = "Give JSON:"


def _params(schema: Any, **kw: Any) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    kw.setdefault("max_tokens", 32)
    return SamplingParams(
        temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema), **kw
    )


def _run(llm: Any, params: list[Any]) -> list[tuple[list[int], str]]:
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


@pytest.fixture(scope="module")
def xgrammar_outputs(engines) -> list[tuple[list[int], str]]:
    return _run(engines.get("xgrammar"), [_params(s) for s in fast_schemas()])


@pytest.fixture
def gramcoord_llm(engines, xgrammar_outputs) -> Any:
    return engines.get("gramcoord")


def test_outputs_token_identical_to_xgrammar(gramcoord_llm, xgrammar_outputs) -> None:
    got = _run(gramcoord_llm, [_params(s) for s in fast_schemas()])
    assert len(got) == 24
    assert all(reason in ("stop", "length") for _, reason in got), [r for _, r in got]
    for i, (mine, theirs) in enumerate(zip(got, xgrammar_outputs)):
        assert mine == theirs, f"schema {i} differs from vLLM + xgrammar"
    assert engine_backend(gramcoord_llm).num_live == 0


def test_refused_schema_is_a_validation_error_with_our_message(gramcoord_llm) -> None:
    from vllm.exceptions import VLLMValidationError

    # vLLM accepts it, but xgrammar would not enforce the required "b".
    ignored = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]}
    with pytest.raises(VLLMValidationError, match="gramcoord refused") as info:
        gramcoord_llm.generate([PROMPT], _params(ignored), use_tqdm=False)
    assert "schema_unsupported_feature" in str(info.value)
    # One vLLM itself refuses: vLLM's own message, not ours.
    unsupported = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(VLLMValidationError, match="not supported by xgrammar"):
        gramcoord_llm.generate([PROMPT], _params(unsupported), use_tqdm=False)
    assert engine_backend(gramcoord_llm).num_live == 0


def test_tokens_after_termination_run_to_max_tokens(gramcoord_llm) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    outs = _run(
        gramcoord_llm,
        [
            _params(schema, max_tokens=48, ignore_eos=True),
            _params(schema, max_tokens=48, ignore_eos=True, stop_token_ids=[11]),
        ],
    )
    for tokens, reason in outs:
        assert reason == "length", outs
        assert len(tokens) == 48


def test_state_released_after_many_requests(gramcoord_llm) -> None:
    schemas = fast_schemas()[:6]
    params = [_params(schemas[i % 6], max_tokens=2) for i in range(300)]
    outs = _run(gramcoord_llm, params)
    assert len(outs) == 300
    assert all(reason in ("stop", "length") for _, reason in outs)
    backend = engine_backend(gramcoord_llm)
    assert backend.num_live == 0
    assert backend.leader.num_live == 0
    assert backend.grammars.num_undecided == 0


@pytest.mark.parametrize("char", ["\t", "\x01"], ids=["tab", "x01"])
def test_a_bounded_string_refuses_a_raw_control_character(gramcoord_llm, char) -> None:
    import xgrammar as xgr

    from gramcoord.rank_worker.config import GrammarConfig
    from gramcoord.rank_worker.grammars.spec import validate_spec

    # xgrammar 0.2.8 (vLLM's pin) lets it into a string with maxLength; the
    # plugin compiles through vLLM's own call, with the class of plain strings.
    _run(gramcoord_llm, [_params({"type": "integer"}, max_tokens=2)])  # the backend exists
    backend = engine_backend(gramcoord_llm)
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}}}
    spec = validate_spec({"json": schema}, GrammarConfig())
    ours = xgr.GrammarMatcher(backend._compile_spec(spec))
    theirs = xgr.GrammarMatcher(backend.host.compiler._compiler.compile_json_schema(spec.text))
    tokenizer = gramcoord_llm.get_tokenizer()
    for token in tokenizer.encode('{"s": "a', add_special_tokens=False):
        assert ours.accept_token(token) and theirs.accept_token(token)
    (control,) = tokenizer.encode(char, add_special_tokens=False)
    assert theirs.accept_token(control)
    assert not ours.accept_token(control)
