"""docs/vllm.md's server, run as written, with the ``openai`` client: replies, refusals, failures.

One server for the module, started by the page's ``# docs-test:`` blocks
themselves (``bash`` in a scratch folder where ``.venv-vllm`` links to the
venv running this test): ``model`` builds the tiny model, ``serve`` starts
the server. Two changes only: the port (8000 in the page; a free one here,
since other runs share the machine), and one ``--additional-config``
appended, whose ``faults`` make a schema naming ``FAULT_BREAK`` fail to
compile and one naming ``FAULT_HANG`` hang in its compile, under a
``COMPILE_TIMEOUT_S`` deadline. Nothing imports gramcoord into the server:
vLLM loads the plugin through its ``vllm.general_plugins`` entry point.

- the page's ``client`` block prints a reply that validates;
- valid schemas finish and validate; 50 concurrent requests are all answered;
- tool calling with ``tool_choice`` required, named and auto (strict tools),
  on BFCL tools, whole and streamed, and a named function through the
  Responses API: served, finished arguments validate;
- a schema the grammar enforces in part is served, and a breach the end
  check catches is a 422 ``schema_breach``, streamed or not; keywords vLLM's
  own rules refuse and keywords beside ``anyOf`` are served;
- bad input through the HTTP API gets the status and message of the
  page's failure table, and the server keeps serving: an invalid schema, a schema that is not an object, a bad regex, a grammar
  that does not parse, a compile error (400), a 200 KB schema past its
  deadline (422); ``{}`` is any JSON (200); the server log names the
  request and the code of each failure inside the engine;
- a bad ``--additional-config`` stops the server at start, naming the field;
- with a spec store, a restarted server compiles what the last one served
  before it is healthy, its first request joins that compile, and a
  timeout on the last one is refused at once.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("openai") is None:
    if os.environ.get("GRAMCOORD_REQUIRE_VLLM") == "1":
        raise RuntimeError("GRAMCOORD_REQUIRE_VLLM=1 but vllm or openai is not importable")
    pytest.skip(
        "vLLM is not installed (make test runs these in .venv-vllm)", allow_module_level=True
    )

import jsonschema
import openai

from gramcoord.benchmarks._vllm_serve import ServerProcess
from tests.integrations.vllm.conftest import FAULT_BREAK, FAULT_HANG
from tests.integrations.vllm.tiny_model import free_port
from tests.load import scaled

pytestmark = [pytest.mark.spawn, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[3]
START_DEADLINE_S = 420.0
MODEL = "tiny-qwen2"
MAX_TOKENS = 32
# Reached by the hanging 200 KB schema (its compile sleeps: all of it is the
# compile's own time). The valid schemas compile inside it however loaded
# the machine: what their niced thread waits for a CPU is not counted, and
# the wall-clock bound is out of reach (tiny_model.COMPILE_DEADLINE).
COMPILE_TIMEOUT_S = 20
EXTRA = {
    "gramcoord": {
        "grammar": {"compile_timeout_s": COMPILE_TIMEOUT_S, "compile_wall_timeout_s": 3600},
        "faults": {
            "compile_error": {"pattern": FAULT_BREAK, "rank": 0},
            "compile_delay": {"pattern": FAULT_HANG, "rank": 0, "seconds": 900, "times": 0},
        },
    }
}
_BLOCK = re.compile(r"^```(\w+)\n# docs-test: (\S+)\n(.*?)^```", re.M | re.S)

SCHEMAS: dict[str, dict] = {
    "flag": {"type": "boolean"},
    "color": {"type": "string", "enum": ["red", "green", "blue"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    },
    "point": {
        "type": "object",
        "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
        "required": ["x", "y"],
        "additionalProperties": False,
    },
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
}
# The grammar emits exactly the enum value and cannot enforce the calendar of
# format "date": every output breaks the schema, and the end check says so.
BREACHED = {"type": "string", "enum": ["2022-02-30"], "format": "date"}
BREACH = "gramcoord schema_breach: the output breaks the schema at $: '2022-02-30' is not a 'date'"


def docs_blocks() -> dict[str, str]:
    """docs/vllm.md's ``# docs-test:`` blocks by name, as written."""
    text = (ROOT / "docs" / "vllm.md").read_text()
    return {m.group(2): m.group(3) for m in _BLOCK.finditer(text)}


def _env() -> dict[str, str]:
    """This session's environment without what the in-process engine tests set.

    The session's vLLM cache is kept: the engines before found the model's
    entry there, so the server does not inspect the model again in a
    subprocess (about 13 CPU-s), as a user's warm cache would not."""
    return {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}


def _scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder like the repository root: ``.venv-vllm`` (this venv) and the model built there."""
    root = tmp_path_factory.mktemp("serve")
    (root / ".venv-vllm").symlink_to(Path(sys.prefix))
    built = subprocess.run(
        ["bash", "-c", docs_blocks()["model"]], cwd=root, env=_env(),
        capture_output=True, text=True, timeout=scaled(600),
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    return root


def serve_script(port: int, extra: dict) -> str:
    script = docs_blocks()["serve"].rstrip()
    assert "--port 8000" in script and script.endswith("--enforce-eager"), script
    script = script.replace("--port 8000", f"--port {port}")
    return f"{script} \\\n    --additional-config '{json.dumps(extra)}'\n"


class Server:
    def __init__(self, proc: ServerProcess) -> None:
        self.proc = proc
        self.url = proc.url
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def log(self) -> str:
        return self.proc.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _scratch(tmp_path_factory)


@pytest.fixture(scope="module")
def server(scratch: Path) -> Iterator[Server]:
    port = free_port()
    proc = ServerProcess(
        serve_script(port, EXTRA), f"http://127.0.0.1:{port}", scratch / "serve.log",
        cwd=scratch, env=_env(),
    )  # fmt: skip
    try:
        try:
            proc.wait_healthy(START_DEADLINE_S)
        except RuntimeError as exc:
            pytest.fail(f"the docs' server: {exc}")
        yield Server(proc)
    finally:
        clean = proc.stop()
    assert clean, "processes of the server outlived SIGKILL of its group"


def _ask(client: openai.OpenAI, name: str, schema, max_tokens: int = MAX_TOKENS, **kw):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Answer with JSON ({name})."}],
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
        max_tokens=max_tokens,
        temperature=0,
        **kw,
    )


def _check(name: str, choice) -> bool:
    """The choice ended without error; True if it finished, and then it validates."""
    assert choice.finish_reason in ("stop", "length"), (name, choice.finish_reason)
    if choice.finish_reason != "stop":
        return False
    jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
    return True


def _still_serving(server: Server) -> None:
    assert _check("flag", _ask(server.client, "flag", SCHEMAS["flag"]).choices[0])


def test_the_docs_client_example_prints_a_valid_reply(server: Server) -> None:
    code = docs_blocks()["client"]
    assert "http://127.0.0.1:8000/v1" in code
    code = code.replace("http://127.0.0.1:8000/v1", f"{server.url}/v1")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(300)
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) in ("red", "green", "blue"), out.stdout


def test_valid_schemas_finish_and_validate(server: Server) -> None:
    finished = [
        name
        for name, schema in SCHEMAS.items()
        if _check(name, _ask(server.client, name, schema).choices[0])
    ]
    # Scalars leave the model no whitespace to write forever: they finish.
    assert {"flag", "color", "count"} <= set(finished), finished


def test_a_breach_the_end_check_catches_is_a_422_schema_breach(server: Server) -> None:
    error = _error(lambda: _ask(server.client, "breached", BREACHED))
    assert error.status_code == 422, error.body
    assert error.body["message"] == BREACH
    # Streamed: the tokens before the last were sent; the stream ends with
    # the error, never with a finish.
    stream = _ask(server.client, "breached", BREACHED, stream=True)
    with pytest.raises(openai.APIError, match="schema_breach"):
        for chunk in stream:
            assert not chunk.choices or chunk.choices[0].finish_reason is None
    assert len(_failure_lines(server, "schema_breach")) == 2
    _still_serving(server)


def test_keywords_xgrammar_would_ignore_are_served(server: Server) -> None:
    # A `not` the grammar does not enforce (end-checked; every output holds),
    # keywords beside anyOf (moved into its branches), and uniqueItems,
    # which vLLM's own xgrammar rules refuse: all served.
    cases = {
        "not": {"type": "string", "enum": ["ab", "abc"], "not": {"const": "x"}},
        "beside-anyof": {
            "type": "object",
            "anyOf": [
                {"properties": {"n": {"enum": [1]}}, "required": ["n"]},
                {"properties": {"n": {"enum": [2]}}, "required": ["n"]},
            ],
        },
        "unique": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 1, "uniqueItems": True},
    }
    for name, schema in cases.items():
        choice = _ask(server.client, name, schema).choices[0]
        assert choice.finish_reason in ("stop", "length"), (name, choice)
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)


def _structured(client: openai.OpenAI, **spec):
    return client.completions.create(
        model=MODEL, prompt="Answer:", max_tokens=8, temperature=0,
        extra_body={"structured_outputs": spec},
    )  # fmt: skip


def _error(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value


def test_bad_input_gets_its_status_and_message(server: Server) -> None:
    c = server.client
    cases = {
        "invalid schema": (lambda: _ask(c, "x", {"type": "nonsense"}), 400, "nonsense"),
        "schema not an object": (lambda: _ask(c, "x", [1, 2]), 400, ""),
        # xgrammar's own words with their position; no log time, no C++ path.
        "bad regex": (
            lambda: _structured(c, regex="(ab"),
            400,
            "Failed to transform regex into a grammar: Regex parsing error at position 4: "
            "The parenthesis is not closed.",
        ),
        "grammar that does not parse": (
            lambda: _structured(c, grammar="root ::= ("),
            400,
            "Invalid grammar specification: EBNF parser error at line 1, column 11",
        ),
    }
    for what, (call, status, text) in cases.items():
        error = _error(call)
        assert error.status_code == status, (what, error.status_code, error.body)
        assert text in str(error.body), (what, error.body)
        assert not re.search(r"\[\d\d:\d\d:\d\d\]|\.cc:\d", str(error.body)), (what, error.body)
    # {} is any JSON: served.
    reply = _ask(c, "any", {}).choices[0]
    assert reply.finish_reason in ("stop", "length")
    if reply.finish_reason == "stop":
        json.loads(reply.message.content)
    _still_serving(server)


def _failure_lines(server: Server, code: str) -> list[str]:
    return [ln for ln in server.log().splitlines() if f"failed: {code}: " in ln]


def test_a_compile_error_in_the_engine_is_a_400_with_its_code(server: Server) -> None:
    schema = {"type": "object", "properties": {f"{FAULT_BREAK}-serve": {"type": "integer"}}}
    error = _error(lambda: _ask(server.client, "broken", schema))
    assert error.status_code == 400
    assert error.body["message"] == (
        "gramcoord grammar_invalid: RuntimeError: fault injected on rank 0: faults.compile_error"
    )
    (line,) = _failure_lines(server, "grammar_invalid")
    assert re.search(r"gramcoord: request \S+ failed: grammar_invalid: RuntimeError", line), line
    _still_serving(server)


def test_a_200kb_schema_past_its_deadline_is_a_422_grammar_timeout(server: Server) -> None:
    props = {f"{FAULT_HANG}-{i:05d}-{'x' * 40}": {"type": "integer"} for i in range(3000)}
    schema = {"type": "object", "properties": props}
    assert len(json.dumps(schema)) > 200_000
    error = _error(lambda: _ask(server.client, "huge", schema))
    assert error.status_code == 422, error.body
    assert error.body["message"] == (
        "gramcoord grammar_timeout: compile ran past --additional-config "
        f"gramcoord.grammar.compile_timeout_s={COMPILE_TIMEOUT_S}s "
        "(its own time: waits for a CPU are not counted)"
    )
    assert len(_failure_lines(server, "grammar_timeout")) == 1
    _still_serving(server)


def test_fifty_concurrent_requests(server: Server) -> None:
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(50)]

    async def ask_all() -> list:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        try:
            return await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"JSON please, #{i}."}],
                        response_format={
                            "type": "json_schema",
                            "json_schema": {"name": name, "schema": SCHEMAS[name]},
                        },
                        max_tokens=MAX_TOKENS,
                        temperature=0,
                    )
                    for i, name in enumerate(names)
                )
            )
        finally:
            await client.close()

    replies = asyncio.run(asyncio.wait_for(ask_all(), timeout=scaled(600)))
    assert len(replies) == 50
    finished = sum(_check(name, r.choices[0]) for name, r in zip(names, replies))
    assert finished >= 3 * 50 // len(SCHEMAS), finished


def test_a_bad_additional_config_stops_the_server_at_start(scratch: Path) -> None:
    bad = {"gramcoord": {"grammar": {"compile_timeout_s": "soon"}}}
    port = free_port()
    proc = ServerProcess(
        serve_script(port, bad), f"http://127.0.0.1:{port}", scratch / "bad.log",
        cwd=scratch, env=_env(),
    )  # fmt: skip
    try:
        rc = proc.wait_exit(START_DEADLINE_S)
    finally:
        assert proc.stop()
    assert rc not in (None, 0), proc.tail()
    assert (
        "--additional-config gramcoord.grammar.compile_timeout_s: Expected `float`, got `str`"
        in proc.log.read_text()
    ), proc.tail()


def _bfcl_tools(n: int) -> list[dict]:
    """``n`` OpenAI tools from the dev data's BFCL records (``{name: parameters}``)."""
    from tests.dev_data import records

    tools = []
    for rec in records():
        if rec.get("source") == "bfcl":
            for name, params in rec["schema"].get("properties", {}).items():
                tools.append({"type": "function", "function": {"name": name, "parameters": params}})
    return tools[:n]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_calls_required_named_and_auto_are_served(server: Server, stream: bool) -> None:
    """vLLM builds each of these constraints itself (a structural tag for the
    hermes format, or its wrapper JSON schema): every one is served, and a
    finished call's arguments parse and validate against the tool's
    parameters."""
    tools = _bfcl_tools(3)
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in tools]
    named = {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
    for what, choice, offered in [
        ("required", "required", tools),
        ("named", named, tools),
        ("auto, strict tools", "auto", strict),
    ]:
        kw = dict(
            model=MODEL,
            messages=[{"role": "user", "content": "Use a tool."}],
            tools=offered,
            tool_choice=choice,
            max_tokens=96,
            temperature=0,
        )
        if not stream:
            choice_out = server.client.chat.completions.create(**kw).choices[0]
            finish, calls = choice_out.finish_reason, choice_out.message.tool_calls or []
            arguments = [(c.function.name, c.function.arguments) for c in calls]
        else:
            finish, pieces = None, {}
            for chunk in server.client.chat.completions.create(**kw, stream=True):
                for c in chunk.choices:
                    finish = c.finish_reason or finish
                    for call in c.delta.tool_calls or []:
                        name, text = pieces.get(call.index, ("", ""))
                        fn = call.function
                        pieces[call.index] = (
                            name + ((fn.name or "") if fn else ""),
                            text + ((fn.arguments or "") if fn else ""),
                        )
            arguments = list(pieces.values())
        assert finish in ("stop", "length", "tool_calls"), (what, finish)
        if finish == "length":
            continue  # cut short: the arguments may be incomplete
        for name, text in arguments:
            jsonschema.validate(json.loads(text), params[name])
    _still_serving(server)


def test_dev_schemas_xgrammar_compiles_are_served_through_response_format(
    server: Server,
) -> None:
    """A sample of 20 dev schemas xgrammar compiles (every k-th, in file
    order): each is served, never refused; a finished reply validates."""
    from gramcoord.launch.workload import dev_data_dir
    from gramcoord.rank_worker.grammars.end_check import end_check
    from tests.dev_data import records

    labels_path = dev_data_dir() / "schemas-dev.xgrammar-labels.jsonl"
    ok = {
        lab["id"]
        for lab in map(json.loads, labels_path.read_text().splitlines())
        if lab.get("status") == "ok"
    }
    served = [r for r in records() if r["id"] in ok]
    sample = served[:: max(1, len(served) // 20)][:20]
    for rec in sample:
        try:
            choice = _ask(server.client, "dev", rec["schema"], max_tokens=16).choices[0]
        except openai.APIStatusError as exc:
            # A breach the end check caught is served and checked, not refused.
            assert exc.status_code == 422 and "schema_breach" in str(exc.body), (rec["id"], exc)
            continue
        assert choice.finish_reason in ("stop", "length"), rec["id"]
        if choice.finish_reason == "stop":
            # As the engine's end check validates: nothing outside the schema fetched.
            assert end_check(json.dumps(rec["schema"]), choice.message.content) is None, rec["id"]


def test_a_named_tool_choice_through_the_responses_api_is_served(server: Server) -> None:
    """The Responses API's forced function: vLLM builds its constraint from the
    tool's parameters; served, and a finished call's arguments validate."""
    (tool,) = _bfcl_tools(1)
    fn = tool["function"]
    reply = server.client.responses.create(
        model=MODEL,
        input="Use the tool.",
        tools=[{"type": "function", "name": fn["name"], "parameters": fn["parameters"]}],
        tool_choice={"type": "function", "name": fn["name"]},
        max_output_tokens=96,
        temperature=0,
    )
    calls = [item for item in reply.output if item.type == "function_call"]
    if reply.status == "completed":
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), fn["parameters"])
    _still_serving(server)


def _store_server(scratch: Path, store: Path, name: str) -> ServerProcess:
    """A server of the docs with a spec store in ``store``, held at start until it is warm."""
    extra = {
        "gramcoord": {
            "grammar": {
                "compile_timeout_s": 5,
                "compile_wall_timeout_s": 3600,
                "store": {"dir": str(store), "ready_wait_s": 600},
            },
            "faults": EXTRA["gramcoord"]["faults"],
        }
    }
    port = free_port()
    proc = ServerProcess(
        serve_script(port, extra), f"http://127.0.0.1:{port}", scratch / f"{name}.log",
        cwd=scratch, env=_env(),
    )  # fmt: skip
    try:
        proc.wait_healthy(START_DEADLINE_S)
    except RuntimeError as exc:
        assert proc.stop()
        pytest.fail(f"the server with a spec store: {exc}")
    return proc


def _wait_for_files(folder: Path, n: int) -> list[Path]:
    deadline = time.monotonic() + scaled(120)
    while time.monotonic() < deadline:
        found = sorted(folder.glob("*.json")) if folder.is_dir() else []
        if len(found) >= n:
            return found
        time.sleep(0.2)
    raise AssertionError(f"{folder}: fewer than {n} records after {scaled(120):.0f} s")


def test_a_restarted_server_answers_a_stored_schema_without_compiling_it(scratch: Path) -> None:
    """The spec store in the real server: what one server served, the next one compiles at
    start, before it is healthy, and its first request for it joins that compile; a timeout
    on the first server is refused at once by the second, with no compile."""
    store = scratch / "spec-store"
    schema = SCHEMAS["point"]
    hang = {"type": "object", "properties": {f"{FAULT_HANG}-store": {"type": "integer"}}}
    first = _store_server(scratch, store, "store-first")
    try:
        client = openai.OpenAI(base_url=f"{first.url}/v1", api_key="none", max_retries=0)
        _check("point", _ask(client, "point", schema).choices[0])
        assert _error(lambda: _ask(client, "hang", hang)).status_code == 422
        (record,) = _wait_for_files(store / "specs", 1)
        _wait_for_files(store / "verdicts", 1)
        assert stat.S_IMODE(record.stat().st_mode) == 0o600
    finally:
        assert first.stop()

    again = _store_server(scratch, store, "store-again")
    try:
        log = again.log.read_text(errors="replace")
        assert "gramcoord spec store: 1 specs compiled at start, 0 refused" in log, again.tail()
        client = openai.OpenAI(base_url=f"{again.url}/v1", api_key="none", max_retries=0)
        reply = _ask(client, "point", schema).choices[0]
        assert reply.finish_reason in ("stop", "length")
        log = again.log.read_text(errors="replace")
        joined = re.findall(r"request (\S+) joined the warm-start compile of \w+ \(compiled\)", log)
        assert len(joined) == 1, again.tail()
        error = _error(lambda: _ask(client, "hang", hang))
        assert error.status_code == 422 and "cached verdict" in error.body["message"], error.body
        assert "its own time" in error.body["message"]  # the first server's words
    finally:
        assert again.stop()
