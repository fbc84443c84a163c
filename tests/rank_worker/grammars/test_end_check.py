"""The end check validates a finished output against its schema, and never
reaches outside the schema for a reference (``end_check``)."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from gramcoord.rank_worker.grammars.end_check import end_check


@pytest.fixture
def counting_server():
    """A loopback HTTP server that serves an integer schema for any path and
    counts the requests it gets; yields (base URL, the list of paths asked)."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            body = b'{"type": "integer"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "{base}/integer.json"},
        {"$schema": "https://json-schema.org/draft/2020-12/schema", "$ref": "{base}/a.json#/x"},
        {"$id": "{base}/tree", "properties": {"kids": {"$ref": "tree.json"}}},
    ],
)
def test_a_reference_outside_the_schema_is_never_fetched(counting_server, schema):
    base, asked = counting_server
    text = json.dumps(schema).replace("{base}", base)
    # Unresolvable here: the output cannot be checked, and is let through.
    assert end_check(text, '{"kids": "x"}') is None
    assert end_check(text, '"not an integer"') is None
    assert asked == []


def test_local_and_meta_schema_references_are_checked():
    local = json.dumps({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"})
    assert end_check(local, "3") is None
    assert (
        end_check(local, '"x"') == "the output breaks the schema at $: 'x' is not of type 'integer'"
    )
    meta = json.dumps({"$ref": "https://json-schema.org/draft/2020-12/schema"})
    assert end_check(meta, '{"type": "string"}') is None
    assert end_check(meta, '{"type": 5}').startswith("the output breaks the schema at $['type']")


def test_an_output_that_is_not_json_is_named():
    assert end_check('{"type": "object"}', "{").startswith("the output is not JSON: ")
