"""``gramcoord bench vllm --parts start``: how long vLLM takes to start, gramcoord against xgrammar.

Two starts, each timed with both backends in alternated order (ABBA: round
``i`` runs gramcoord first when ``i`` is even), every start a fresh child
process on the same tiny model:

- ``llm``: an offline ``LLM(...)`` (vLLM's default engine-core process;
  gramcoord's ``register()`` first, as docs/vllm.md says), timed inside the
  child from before vLLM is imported until ``LLM(...)`` returns;
- ``server``: the OpenAI server of docs/vllm.md (``_vllm_serve.serve_args``),
  timed from its spawn until ``/health`` answers 200.

Before the timed rounds, each kind starts once per backend untimed: the
first start on a machine fills vLLM's cache directory and the page cache
for every module both backends load, and ABBA would hand that cost to
whichever backend round 0 runs first (gramcoord: 93.5 s of CPU for its
first offline start against 66.5 s for its second, on a quiet machine).

The baseline is vLLM as if gramcoord were not installed: backend
``xgrammar`` with ``VLLM_PLUGINS=""``, so vLLM loads no plugin, and the
gramcoord start pays for the plugin in every process vLLM starts. Records:
the median of each, ratio = xgrammar / gramcoord (target: within 10%,
ratio >= 1/1.1), and every pair's ratio in the note, which a shared
machine's load drift shows up in.

``python -m gramcoord.benchmarks._vllm_start MODEL BACKEND OUT`` is the
offline child.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gramcoord.benchmarks._contract import BenchRecord
from gramcoord.benchmarks._vllm_common import cpu_env

BACKENDS = ("gramcoord", "xgrammar")
START_TARGET = round(1 / 1.1, 3)


def child_env(backend: str, cache_root: Path) -> dict[str, str]:
    """The environment of one start: vLLM's CPU settings; no plugin for the baseline."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS",)}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.update(cpu_env(cache_root))
    env.setdefault("OMP_NUM_THREADS", "1")
    if backend == "xgrammar":
        env["VLLM_PLUGINS"] = ""
    return env


def order(rounds: int) -> list[str]:
    """ABBA...: the backends of every start, in the order they run."""
    out: list[str] = []
    for i in range(rounds):
        out += BACKENDS if i % 2 == 0 else BACKENDS[::-1]
    return out


def _llm_start(model: Path, backend: str, work: Path, timeout_s: float) -> float:
    from gramcoord.benchmarks._vllm_serve import ServerProcess

    out = work / f"start-llm-{backend}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "gramcoord.benchmarks._vllm_start", str(model), backend, str(out)]
    env = child_env(backend, work / "vllm-cache")
    child = ServerProcess(cmd, "", out.with_suffix(".log"), env=env)
    try:
        rc = child.wait_exit(timeout_s)
    finally:
        child.stop()
    if rc != 0:
        why = "timed out" if rc is None else f"exit {rc}"
        raise SystemExit(f"bench vllm start: LLM(...) with {backend}: {why}:\n{child.tail(25)}")
    return json.loads(out.read_text())["llm_s"]


def _server_start(model: Path, backend: str, work: Path, timeout_s: float) -> float:
    from gramcoord.benchmarks._vllm_serve import ServerProcess, serve_args
    from gramcoord.launch.ports import free_port

    port = free_port()
    log = work / f"start-server-{backend}-{time.monotonic_ns()}.log"
    env = child_env(backend, work / "vllm-cache")
    proc = ServerProcess(serve_args(model, port, backend), f"http://127.0.0.1:{port}", log, env=env)
    try:
        return proc.wait_healthy(timeout_s)
    except RuntimeError as exc:
        raise SystemExit(f"bench vllm start: the server with {backend}: {exc}") from None
    finally:
        proc.stop()


def measure(model: Path, work: Path, rounds: int, timeout_s: float) -> dict[str, Any]:
    """Every start, in ABBA order: ``{"llm": {backend: [s, ...]}, "server": {...}}``."""
    got: dict[str, Any] = {"rounds": rounds}
    for kind, start in (("llm", _llm_start), ("server", _server_start)):
        got[kind] = {b: [] for b in BACKENDS}
        for backend in BACKENDS:  # untimed warm-up (module docstring)
            start(model, backend, work, timeout_s)
        for backend in order(rounds):
            got[kind][backend].append(start(model, backend, work, timeout_s))
            print(f"bench vllm start: {kind} {backend} {got[kind][backend][-1]:.1f} s", flush=True)
    return got


def start_records(got: dict[str, Any]) -> list[BenchRecord]:
    """Median start with gramcoord against xgrammar (no plugin), per kind, pair ratios noted."""
    what = {
        "llm": "offline import of vLLM and LLM(...), timed in a fresh child",
        "server": "OpenAI server (python -m vllm.entrypoints.openai.api_server) spawn to "
        "/health 200",
    }
    out = []
    for kind, text in what.items():
        gc, xg = got[kind]["gramcoord"], got[kind]["xgrammar"]
        pairs = ", ".join(f"{x / g:.3f}" for g, x in zip(gc, xg))
        out.append(
            BenchRecord.compare(
                f"vllm_start_{kind}_gramcoord",
                f"vllm_start_{kind}_xgrammar",
                statistics.median(gc) * 1e3,
                statistics.median(xg) * 1e3,
                target=START_TARGET,
                note=f"{text}; {got['rounds']} rounds ABBA after one untimed start each; xgrammar with VLLM_PLUGINS='' "
                f"(gramcoord not loaded); pair ratios xgrammar/gramcoord: {pairs}; "
                f"gramcoord s: {', '.join(f'{s:.1f}' for s in gc)}; "
                f"xgrammar s: {', '.join(f'{s:.1f}' for s in xg)}",
            )
        )
    return out


def _llm_main(model: str, backend: str, out: str) -> None:
    t0 = time.perf_counter()  # both pay for importing vLLM; gramcoord for its plugin too
    from gramcoord.benchmarks._vllm_common import ENGINE_KW

    if backend == "gramcoord":
        from gramcoord.integrations.vllm.plugin import register

        register()
    from vllm import LLM

    llm = LLM(model, structured_outputs_config={"backend": backend}, **ENGINE_KW)
    took = time.perf_counter() - t0
    Path(out).write_text(json.dumps({"backend": backend, "llm_s": took}))
    del llm


if __name__ == "__main__":
    _llm_main(*sys.argv[1:])
