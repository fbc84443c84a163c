"""gramcoord inside the real vLLM 0.32 engine, one process: outputs, refusals, state."""

from __future__ import annotations

import json
import os
import threading
import time
import types
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


# The grammar emits exactly the enum value, and cannot enforce the calendar
# of format "date": every output breaks the schema, which the end check
# catches. Beside it, a `not` the grammar does not enforce, whose outputs
# all hold.
BREACHED = {"type": "string", "enum": ["2022-02-30"], "format": "date"}
CHECKED = {"type": "string", "enum": ["ab", "abc"], "not": {"const": "x"}}


def test_a_schema_enforced_in_part_is_served_and_its_breach_fails_with_its_code(
    gramcoord_llm,
) -> None:
    held, broke = gramcoord_llm.generate(
        [PROMPT] * 2, [_params(CHECKED), _params(BREACHED)], use_tqdm=False
    )
    assert held.outputs[0].finish_reason == "stop"
    assert json.loads(held.outputs[0].text) in ("ab", "abc")
    assert broke.outputs[0].finish_reason == "error"
    assert broke.outputs[0].stop_reason == (
        "gramcoord schema_breach: the output breaks the schema at $: '2022-02-30' is not a 'date'"
    )
    # Features vLLM's own xgrammar rules refuse are served too (end-checked).
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    (out,) = gramcoord_llm.generate([PROMPT], _params(unique), use_tqdm=False)
    assert out.outputs[0].finish_reason in ("stop", "length", "error"), out.outputs[0]
    backend = engine_backend(gramcoord_llm)
    assert backend.num_live == 0 and not backend.breaches and not backend._checked


def test_keywords_beside_a_combinator_are_served_enforced(gramcoord_llm) -> None:
    # vLLM's tool_choice="required" shape: type beside anyOf, moved into
    # every branch, so the grammar enforces it whole (no end check).
    from gramcoord.integrations.vllm.options import front_end_config
    from gramcoord.rank_worker.grammars.spec import validate_spec

    schema = {
        "type": "object",
        "anyOf": [
            {"properties": {"name": {"enum": ["a"]}}, "required": ["name"]},
            {"properties": {"name": {"enum": ["b"]}}, "required": ["name"]},
        ],
    }
    spec = validate_spec({"json": schema}, front_end_config(False))
    assert not spec.end_check and not spec.warnings
    (out,) = gramcoord_llm.generate([PROMPT], _params(schema), use_tqdm=False)
    assert out.outputs[0].finish_reason in ("stop", "length")
    if out.outputs[0].finish_reason == "stop":
        assert json.loads(out.outputs[0].text) in ({"name": "a"}, {"name": "b"})


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
    assert backend.grammars.num_live == 0
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


def _peak_threads(fn: Any) -> tuple[Any, int]:
    """``fn()``, and how many more threads the process had at its peak during the call."""
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], len(os.listdir("/proc/self/task")))
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(0.01)
    before = len(os.listdir("/proc/self/task"))
    try:
        return fn(), peak[0] - before
    finally:
        stop.set()
        watcher.join()


def test_compiles_run_on_a_niced_compile_thread_with_no_threads_of_their_own(
    gramcoord_llm, monkeypatch
) -> None:
    """While vLLM's scheduler runs requests, a compile is one thread at nice +10;
    one that starts while nothing runs may use every CPU, its threads at that nice."""
    import xgrammar as xgr

    from gramcoord.integrations.vllm.backend import lone_compile_threads

    def schema() -> dict:
        # A compile long enough for xgrammar's threads to show (many bounded strings).
        props = {
            f"p{i}_{time.time_ns()}": {"type": "string", "maxLength": 3 + i % 9} for i in range(40)
        }
        return {"type": "object", "properties": props}

    _run(gramcoord_llm, [_params({"type": "integer"}, max_tokens=2)])  # the backend exists
    backend = engine_backend(gramcoord_llm)
    seen: list[tuple[str, int, int, int]] = []

    def record(name: str, compiler: Any) -> None:
        original = compiler.compile_json_schema

        def recording(*args: Any, **kwargs: Any) -> Any:
            tid = threading.get_native_id()
            got, extra = _peak_threads(lambda: original(*args, **kwargs))
            seen.append((name, tid, os.getpriority(os.PRIO_PROCESS, tid), extra))
            return got

        monkeypatch.setattr(compiler, "compile_json_schema", recording)

    record("busy", backend.host.compiler)
    if lone_compile_threads() == 1:
        pytest.skip("one CPU: a lone compile has no more threads to use")
    record("lone", backend._lone().compiler)
    # The scheduler as the compile thread reads it: a request running, then none.
    scheduler = types.SimpleNamespace(running=[object()])
    monkeypatch.setattr(backend, "_scheduler", scheduler)
    for running in ([object()], []):
        scheduler.running = running
        ((tokens, reason),) = _run(gramcoord_llm, [_params(schema(), max_tokens=4)])
        assert reason == "length" and len(tokens) == 4
    (busy, tid, nice, extra), (lone, _, lone_nice, lone_extra) = seen
    assert (busy, lone) == ("busy", "lone")
    # Compiled on a compile-pool thread at nice +10, not on the engine's thread ...
    assert tid != threading.main_thread().native_id
    assert backend.config.compile_nice == 10
    assert nice == lone_nice == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
    # ... by that thread alone while requests run: xgrammar started none (vLLM's starts 8).
    assert extra == 0
    compiler = backend.host.compiler
    eight = xgr.GrammarCompiler(
        compiler.compile_grammar('root ::= "a"').tokenizer_info, max_threads=8, cache_enabled=False
    )
    _, extra8 = _peak_threads(lambda: eight.compile_json_schema(json.dumps(schema())))
    assert extra8 > 0  # the count above would have seen them
    # Alone, with every CPU of the process (their threads inherit the nice).
    assert lone_extra > 0


def test_a_lone_compile_sends_its_own_threads_to_nice_19_once_requests_decode() -> None:
    """``LoneCompile.yield_cpus``: the threads started after the compile did, under its
    name, go to nice 19; the compile thread and every other thread keep theirs."""
    from gramcoord.integrations.vllm.backend import LoneCompile
    from gramcoord.rank_worker.grammars.compile_job import name_compile_thread

    base = os.getpriority(os.PRIO_PROCESS, 0)
    nice = min(18, base + 10)
    got: dict[str, int] = {}
    stop = threading.Event()

    def helper(name: str) -> None:  # a thread xgrammar would start inside the compile
        got[name] = threading.get_native_id()
        stop.wait(30)

    def compile_thread() -> None:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, nice)
        name_compile_thread()  # as the compile pool names its workers
        lone = LoneCompile(nice - base)
        helpers = [threading.Thread(target=helper, args=(f"h{i}",)) for i in range(2)]
        for h in helpers:
            h.start()
        while len(got) < 2:
            time.sleep(0.01)
        lone.yield_cpus()
        got["compile"] = tid
        got["compile_nice"] = os.getpriority(os.PRIO_PROCESS, tid)
        got["helper_nice"] = [os.getpriority(os.PRIO_PROCESS, got[f"h{i}"]) for i in range(2)]
        stop.set()
        for h in helpers:
            h.join()

    other = threading.Thread(target=stop.wait, args=(30,))  # the engine's, at the base nice
    other.start()
    t = threading.Thread(target=compile_thread)
    t.start()
    t.join(30)
    other.join(30)
    assert got["helper_nice"] == [19, 19]
    assert got["compile_nice"] == nice  # a pool worker: later compiles run on it
    assert os.getpriority(os.PRIO_PROCESS, 0) == base
