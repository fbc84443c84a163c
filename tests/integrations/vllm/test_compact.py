"""With ``disable_any_whitespace``: token-identical to vLLM + xgrammar (separators ``,`` ``:``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.integrations.vllm.conftest import engine_backend, fast_schemas
from tests.integrations.vllm.test_engine import _params, _run

pytestmark = pytest.mark.timeout(600)


def test_compact_outputs_token_identical_to_xgrammar(engines) -> None:
    results = {}
    for backend in ("xgrammar", "gramcoord"):
        # Fresh params: vLLM stamps the engine's backend name into each. No
        # local reference: the slot must be able to shut the engine down.
        results[backend] = _run(engines.get(backend, True), [_params(s) for s in fast_schemas()])
    assert engine_backend(engines.llm).num_live == 0
    assert all(reason in ("stop", "length") for _, reason in results["gramcoord"])
    for i, (mine, theirs) in enumerate(zip(results["gramcoord"], results["xgrammar"])):
        assert mine == theirs, f"schema {i} differs from vLLM + xgrammar (compact)"
