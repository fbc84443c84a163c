"""Tool calling: the schemas vLLM builds itself, served by gramcoord.

vLLM builds the ``tool_choice="required"`` schema from the request's tools
(``vllm.tool_parsers.utils.get_json_schema_from_tools``):
``{"type": "array", "minItems": 1, "items": {"type": "object", "anyOf":
[one branch per tool]}}``, and for a named choice the tool's own
parameters. The tools here are the BFCL functions of the dev data (each
record's schema is ``{"function name": parameters}``). Every such schema
passes gramcoord's front-end validation under vLLM and, in the real engine,
the finished calls parse and validate.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

pytest.importorskip("vllm")

from tests.dev_data import records

pytestmark = pytest.mark.timeout(600)


def bfcl_tools() -> list[dict[str, Any]]:
    """OpenAI tool definitions from the BFCL records, one per function."""
    tools = []
    for rec in records():
        if rec.get("source") != "bfcl":
            continue
        for name, params in rec["schema"].get("properties", {}).items():
            if isinstance(params, dict):
                tools.append({"type": "function", "function": {"name": name, "parameters": params}})
    assert tools, "no BFCL records in the dev data"
    return tools


def _params(tools: list[dict], choice: Any) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    parsed = [ChatCompletionToolsParam.model_validate(t) for t in tools]
    return get_json_schema_from_tools(choice, parsed)


def _named(name: str) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionNamedToolChoiceParam,
    )

    return ChatCompletionNamedToolChoiceParam.model_validate(
        {"type": "function", "function": {"name": name}}
    )


def test_every_tool_choice_vllm_builds_is_served() -> None:
    from gramcoord.integrations.vllm.options import front_end_config
    from gramcoord.rank_worker.grammars.spec import validate_spec

    config = front_end_config(False)
    tools = bfcl_tools()
    # tool_choice="required" over groups of four tools: the wrapper's type
    # beside anyOf moves into each branch, enforced whole where each tool's
    # parameters are.
    for i in range(0, len(tools), 4):
        group = tools[i : i + 4]
        wrapper = _params(group, "required")
        spec = validate_spec({"json": wrapper}, config)
        alone = [
            validate_spec({"json": t["function"]["parameters"]}, config).end_check for t in group
        ]
        assert spec.end_check is any(alone), (group, spec.warnings)
        for tool in group:
            name = tool["function"]["name"]
            validate_spec({"json": _params(group, _named(name))}, config)


def test_required_tool_calls_finish_as_valid_calls(engines) -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = engines.get("gramcoord")
    tools = bfcl_tools()[:6]
    schemas = [_params(tools[i : i + 3], "required") for i in (0, 3)]
    outs = llm.generate(
        ["Call a tool:"] * len(schemas),
        [
            SamplingParams(
                temperature=0.0,
                max_tokens=96,
                structured_outputs=StructuredOutputsParams(json=schema),
            )
            for schema in schemas
        ],
        use_tqdm=False,
    )
    for schema, out in zip(schemas, outs, strict=True):
        done = out.outputs[0]
        assert done.finish_reason in ("stop", "length"), done
        if done.finish_reason == "stop":
            calls = json.loads(done.text)
            jsonschema.validate(calls, schema)
            assert all({"name", "parameters"} <= set(call) for call in calls)


def test_every_dev_schema_xgrammar_compiles_passes_gramcoords_front_end() -> None:
    """Serve what xgrammar serves: no dev schema that xgrammar compiles is
    refused by gramcoord's validation under vLLM (rewritten, or checked at
    the end, instead)."""
    from gramcoord.integrations.vllm.options import front_end_config
    from gramcoord.launch.workload import dev_data_dir
    from gramcoord.rank_worker.errors import SpecError
    from gramcoord.rank_worker.grammars.spec import validate_spec

    labels_path = dev_data_dir() / "schemas-dev.xgrammar-labels.jsonl"
    labels = {json.loads(ln)["id"]: json.loads(ln) for ln in labels_path.read_text().splitlines()}
    config = front_end_config(False)
    refused, served = [], 0
    for rec in records():
        if labels.get(rec["id"], {}).get("status") != "ok":
            continue
        try:
            validate_spec({"json": rec["schema"]}, config)
            served += 1
        except SpecError as exc:
            refused.append((rec["id"], exc.code.name, exc.message[:200]))
    assert served and not refused, refused
