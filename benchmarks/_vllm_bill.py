"""``gramcoord bench vllm --parts bill``: what one big schema costs a user, cold, warm and restarted.

The real OpenAI server of docs/vllm.md (``_vllm_serve.serve_args``), one per
backend at a time, on the tiny model; the client is ``openai``, streaming,
and TTFT is the time from the request to its first content chunk. One big
schema (``big_schema``: 500 required properties of six kinds) is asked:

- ``cold``: the first request for it after the server is healthy (a
  compile on a fresh server);
- ``warm``: the same request again, ``--bill-repeats`` times, the median (a
  cache hit);
- ``restart``: the server is stopped and started again on the same spec
  store, and the first request for it. gramcoord runs with
  ``grammar.store`` (``dir`` per round, ``ready_wait_s`` so the restarted
  server is healthy once its stored specs are compiled: the server's start
  time, reported beside, carries that compile); vLLM's xgrammar backend has
  nothing to keep, so its restart is cold again.

Each server first answers one unconstrained request (``plain``, timed
and reported): vLLM's own first-request costs (about half a second on a
busy machine here, on either backend) then fall on neither schema request.
Rounds alternate the backends (ABBA). The baseline is vLLM as a user runs it
without gramcoord: backend ``xgrammar`` with ``VLLM_PLUGINS=""``. Every
reply's text is kept: the two backends must give the same text (greedy, the
same vocabulary and compile calls), and the note says whether they did.

Two more, offline (``LLM.generate``, one in-process engine per child, the
children ABBA, ``python -m gramcoord.benchmarks._vllm_bill decode``):

- ``throughput``: ``--bill-requests`` dev schemas, every request
  constrained, ``--bill-tokens`` tokens each (greedy, ``ignore_eos``),
  tokens per second; and the same prompts unconstrained, for the cost of
  constraints on each backend;
- ``mixing radius``: a batch of 64 with one constrained request against
  the same batch with none: how much slower the step of the whole batch
  (every output is ``--bill-tokens`` long, so the batch's time per token).

Records (ratio = xgrammar / gramcoord, higher is better): cold, warm and
restart TTFT against xgrammar's (targets: cold and warm >= 1.0); gramcoord's
restart against its own warm TTFT (target: restart at most 1.2x warm, ratio
>= 0.833); the restarted server's start, both backends; constrained
throughput (target >= 1.0) and the mixing radius (target: no worse than
xgrammar's). The constrained outputs' token ids must be the same on both
backends; the notes say whether they were.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gramcoord.benchmarks._contract import BenchRecord

BACKENDS = ("gramcoord", "xgrammar")
RESTART_TARGET = round(1 / 1.2, 3)
_KINDS = (
    {"type": "string", "maxLength": 16},
    {"type": "integer", "minimum": 0, "maximum": 999},
    {"type": "boolean"},
    {"type": "string", "enum": ["north", "south", "east", "west"]},
    {"type": "number"},
    {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
)


def big_schema(n: int = 500) -> dict[str, Any]:
    """``n`` required properties, cycling over six kinds: a compile of seconds."""
    props = {f"field_{i:03d}": dict(_KINDS[i % len(_KINDS)]) for i in range(n)}
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


def _ttft(url: str, schema: dict | None, max_tokens: int, timeout_s: float) -> tuple[float, str]:
    """Seconds to the first content chunk of one streamed request, and the whole text
    (``schema`` None: unconstrained)."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout_s)
    extra: dict[str, Any] = {}
    if schema is not None:
        extra["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "form", "schema": schema},
        }
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model="tiny-qwen2",
        messages=[{"role": "user", "content": "Fill in the form as JSON."}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        **extra,
    )
    first, text = None, []
    for chunk in stream:
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta:
            if first is None:
                first = time.perf_counter() - t0
            text.append(delta)
    if first is None:
        raise SystemExit("bench vllm bill: a reply came without any content")
    return first, "".join(text)


def _server(model: Path, backend: str, work: Path, store: Path, timeout_s: float):
    from gramcoord.benchmarks._vllm_serve import ServerProcess, serve_args
    from gramcoord.benchmarks._vllm_start import child_env
    from gramcoord.launch.ports import free_port

    port = free_port()
    cmd = serve_args(model, port, backend)
    if backend == "gramcoord":
        grammar = {"compile_timeout_s": 600, "store": {"dir": str(store), "ready_wait_s": 600}}
        cmd += ["--additional-config", json.dumps({"gramcoord": {"grammar": grammar}})]
    log = work / f"bill-{backend}-{time.monotonic_ns()}.log"
    proc = ServerProcess(
        cmd, f"http://127.0.0.1:{port}", log, env=child_env(backend, work / "vllm-cache")
    )
    try:
        started = proc.wait_healthy(timeout_s)
    except RuntimeError as exc:
        proc.stop()
        raise SystemExit(f"bench vllm bill: the server with {backend}: {exc}") from None
    return proc, started


def _one_round(model: Path, backend: str, work: Path, round_no: int, opts: Any) -> dict:
    schema = big_schema(opts.bill_properties)
    store = work / f"bill-store-{round_no}-{backend}"
    got: dict[str, Any] = {}
    proc, got["start_s"] = _server(model, backend, work, store, opts.timeout_s)
    try:
        got["plain_s"] = _ttft(proc.url, None, opts.max_tokens, opts.timeout_s)[0]
        got["cold_s"], got["text"] = _ttft(proc.url, schema, opts.max_tokens, opts.timeout_s)
        warm = [
            _ttft(proc.url, schema, opts.max_tokens, opts.timeout_s)
            for _ in range(opts.bill_repeats)
        ]
        got["warm_s"] = statistics.median(t for t, _ in warm)
        got["same_text"] = all(text == got["text"] for _, text in warm)
    finally:
        proc.stop()
    proc, got["restart_start_s"] = _server(model, backend, work, store, opts.timeout_s)
    try:
        got["restart_plain_s"] = _ttft(proc.url, None, opts.max_tokens, opts.timeout_s)[0]
        got["restart_s"], text = _ttft(proc.url, schema, opts.max_tokens, opts.timeout_s)
        got["same_text"] = got["same_text"] and text == got["text"]
    finally:
        proc.stop()
    print(
        f"bench vllm bill: round {round_no} {backend}: cold {got['cold_s']:.3f} s, warm "
        f"{got['warm_s'] * 1e3:.1f} ms, restart {got['restart_s'] * 1e3:.1f} ms "
        f"(start {got['start_s']:.1f} s, restart start {got['restart_start_s']:.1f} s; "
        f"first plain request {got['plain_s'] * 1e3:.0f} ms, after the restart "
        f"{got['restart_plain_s'] * 1e3:.0f} ms)",
        flush=True,
    )
    return got


def measure(model: Path, work: Path, opts: Any) -> dict[str, Any]:
    """Every round of both backends, ABBA: ``{backend: [round, ...]}``."""
    got: dict[str, list[dict]] = {b: [] for b in BACKENDS}
    for i in range(opts.bill_rounds):
        for backend in BACKENDS if i % 2 == 0 else BACKENDS[::-1]:
            got[backend].append(_one_round(model, backend, work, i, opts))
    return {"rounds": opts.bill_rounds, "properties": opts.bill_properties, **got}


def bill_records(got: dict[str, Any]) -> list[BenchRecord]:
    """The bill's table: TTFT cold, warm and restarted, and the restarted start."""
    gc, xg = got["gramcoord"], got["xgrammar"]

    def med(rounds: list[dict], field: str) -> float:
        return statistics.median(r[field] for r in rounds) * 1e3

    def each(rounds: list[dict], field: str) -> str:
        return ", ".join(f"{r[field] * 1e3:.0f}" for r in rounds)

    same = all(g["text"] == x["text"] for g, x in zip(gc, xg))
    steady = all(r["same_text"] for r in gc + xg)
    base = (
        f"{got['properties']}-property schema, streamed TTFT on the OpenAI server, "
        f"{got['rounds']} rounds ABBA, each server's first request an unconstrained one "
        f"(gramcoord ms: {each(gc, 'plain_s')}, after a restart {each(gc, 'restart_plain_s')}; "
        f"xgrammar ms: {each(xg, 'plain_s')}, {each(xg, 'restart_plain_s')}); "
        f"xgrammar with VLLM_PLUGINS=''; replies identical "
        f"across backends: {same}, within each server: {steady}"
    )
    out = []
    for field, what, target in (
        ("cold_s", "first request after start (a compile)", 1.0),
        ("warm_s", "the same request again (a cache hit), median of the repeats", 1.0),
        ("restart_s", "first request after a restart (gramcoord: spec store)", None),
    ):
        out.append(
            BenchRecord.compare(
                f"vllm_bill_ttft_{field[:-2]}_gramcoord",
                f"vllm_bill_ttft_{field[:-2]}_xgrammar",
                med(gc, field),
                med(xg, field),
                target=target,
                note=f"{what}; {base}; gramcoord ms: {each(gc, field)}; "
                f"xgrammar ms: {each(xg, field)}",
            )
        )
    out.append(
        BenchRecord.compare(
            "vllm_bill_restart_over_warm_gramcoord",
            "vllm_bill_ttft_warm_gramcoord",
            med(gc, "restart_s"),
            med(gc, "warm_s"),
            target=RESTART_TARGET,
            note=f"gramcoord's TTFT after a restart against its own warm TTFT (target: at "
            f"most 1.2x); xgrammar's restart is {med(xg, 'restart_s') / med(xg, 'warm_s'):.1f}x "
            f"its warm; {base}",
        )
    )
    out.append(
        BenchRecord.compare(
            "vllm_bill_restart_start_gramcoord",
            "vllm_bill_restart_start_xgrammar",
            med(gc, "restart_start_s"),
            med(xg, "restart_start_s"),
            note="the restarted server's spawn to /health 200 (gramcoord holds it until the "
            "stored specs are compiled: grammar.store.ready_wait_s); "
            f"gramcoord ms: {each(gc, 'restart_start_s')}; "
            f"xgrammar ms: {each(xg, 'restart_start_s')}",
        )
    )
    return out


# -- offline: throughput and the mixing radius -------------------------------------


def _decode_child(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m gramcoord.benchmarks._vllm_bill decode")
    p.add_argument("--model", required=True)
    p.add_argument("--backend", required=True, choices=BACKENDS)
    p.add_argument("--cache-root", required=True)
    p.add_argument("--requests", type=int, required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--repeat", type=int, required=True)
    p.add_argument("--data", default=None)
    p.add_argument("--out", type=Path, required=True)
    opts = p.parse_args(argv)
    from gramcoord.benchmarks._vllm_common import dev_schemas, make_llm, params, setup_env

    setup_env(opts.cache_root)
    llm = make_llm(opts.model, opts.backend)
    schemas = dev_schemas(opts.data, opts.requests)
    prompts = [f"Reply with JSON, please ({i})." for i in range(len(schemas))]
    constrained = [params(s, opts.tokens) for s in schemas]
    plain = [params(None, opts.tokens) for _ in schemas]
    batch = [f"Tell me something ({i})." for i in range(64)]
    mixed = [params(schemas[0], opts.tokens)] + [params(None, opts.tokens)] * 63
    alone = [params(None, opts.tokens)] * 64

    def timed(prompts: list[str], sampling: list) -> tuple[float, list]:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        return time.perf_counter() - t0, outs

    _, first = timed(prompts, constrained)  # compiles every grammar once
    timed(batch, mixed)
    got: dict[str, Any] = {"tokens": opts.tokens, "requests": len(schemas)}
    got["ids"] = [list(o.outputs[0].token_ids) for o in first]
    for name, args in (
        ("constrained_s", (prompts, constrained)),
        ("plain_s", (prompts, plain)),
        ("mixed_s", (batch, mixed)),
        ("alone_s", (batch, alone)),
    ):
        got[name] = [timed(*args)[0] for _ in range(opts.repeat)]
    opts.out.write_text(json.dumps(got))
    return 0


def measure_decode(model: Path, work: Path, opts: Any) -> dict[str, Any]:
    """Both backends' offline children, ABBA over ``bill_rounds``: ``{backend: [result, ...]}``."""
    from gramcoord.benchmarks._vllm_serve import ServerProcess
    from gramcoord.benchmarks._vllm_start import child_env

    got: dict[str, list[dict]] = {b: [] for b in BACKENDS}
    for i in range(opts.bill_rounds):
        for backend in BACKENDS if i % 2 == 0 else BACKENDS[::-1]:
            out = work / f"bill-decode-{i}-{backend}.json"
            cmd = [sys.executable, "-m", "gramcoord.benchmarks._vllm_bill", "decode"]
            cmd += ["--model", str(model), "--backend", backend, "--out", str(out)]
            cmd += ["--cache-root", str(work / "vllm-cache")]
            cmd += ["--requests", str(opts.bill_requests), "--tokens", str(opts.bill_tokens)]
            cmd += ["--repeat", str(opts.bill_repeats)]
            cmd += ["--data", opts.data] if opts.data else []
            child = ServerProcess(
                cmd, "", out.with_suffix(".log"), env=child_env(backend, work / "vllm-cache")
            )
            try:
                rc = child.wait_exit(opts.timeout_s)
            finally:
                child.stop()
            if rc != 0:
                why = "timed out" if rc is None else f"exit {rc}"
                raise SystemExit(
                    f"bench vllm bill: decode with {backend}: {why}:\n{child.tail(25)}"
                )
            got[backend].append(json.loads(out.read_text()))
            print(f"bench vllm bill: decode round {i} {backend} done", flush=True)
    return got


def decode_records(got: dict[str, list[dict]]) -> list[BenchRecord]:
    """Constrained throughput and the mixing radius, gramcoord against xgrammar."""
    gc, xg = got["gramcoord"], got["xgrammar"]

    def med(runs: list[dict], field: str) -> float:
        return statistics.median(t for r in runs for t in r[field])

    same = all(g["ids"] == x["ids"] for g, x in zip(gc, xg))
    n, tokens = gc[0]["requests"], gc[0]["tokens"]
    base = (
        f"offline LLM.generate, in-process engine per child, {len(gc)} rounds ABBA; xgrammar "
        f"with VLLM_PLUGINS=''; constrained token ids identical across backends: {same}"
    )
    per = {b: n * tokens / med(runs, "constrained_s") for b, runs in got.items()}
    cost = {b: med(runs, "constrained_s") / med(runs, "plain_s") for b, runs in got.items()}
    radius = {b: med(runs, "mixed_s") / med(runs, "alone_s") for b, runs in got.items()}
    return [
        BenchRecord.compare(
            "vllm_bill_constrained_gramcoord",
            "vllm_bill_constrained_xgrammar",
            med(gc, "constrained_s") * 1e3,
            med(xg, "constrained_s") * 1e3,
            target=1.0,
            note=f"{n} dev-schema requests x {tokens} tokens, every one constrained: "
            f"tokens/s gramcoord {per['gramcoord']:.0f}, xgrammar {per['xgrammar']:.0f}; "
            f"constrained / unconstrained time gramcoord {cost['gramcoord']:.2f}, "
            f"xgrammar {cost['xgrammar']:.2f}; {base}",
        ),
        BenchRecord.compare(
            "vllm_bill_mixing_radius_gramcoord",
            "vllm_bill_mixing_radius_xgrammar",
            radius["gramcoord"],
            radius["xgrammar"],
            target=1.0,
            note="a batch of 64 x "
            f"{tokens} tokens with one constrained request, its time over the same batch with "
            f"none (1.0: no radius); the 'ms' columns hold that ratio; {base}",
        ),
    ]


if __name__ == "__main__":
    if sys.argv[1:2] != ["decode"]:
        raise SystemExit("usage: python -m gramcoord.benchmarks._vllm_bill decode ...")
    sys.exit(_decode_child(sys.argv[2:]))
