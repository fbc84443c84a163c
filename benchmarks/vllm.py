"""gramcoord inside real vLLM 0.32 against vLLM's own xgrammar backend.

Needs vLLM (``make venv-vllm``; run it as ``.venv-vllm/bin/gramcoord bench
vllm``); without it, it exits with a note and ``gramcoord bench all`` skips
it. The tiny offline model (``_vllm_common``) is built once into the output
folder. Every engine runs in a child process with a deadline, its process
group ended on every path. Two parts, both measured in this one run with
the same requests for both backends:

- ``step`` (``_vllm_child step``, one in-process engine per backend): the median
  ``EngineCore.step`` while N JSON-constrained requests decode, gramcoord
  against vLLM's xgrammar backend (target: no slower, ratio >= 1.0); each
  against the same batch unconstrained (report only); and where the step
  goes: vLLM's own functions, wrapped with timers in the child (the
  forward, the scheduler's ``get_grammar_bitmask``, the worker's
  ``sample_tokens`` and within it ``apply_grammar_bitmask``, ...).
- ``hol`` (``_vllm_child hol``, ``torchrun --nproc-per-node 2``, TP=2, external
  launcher, gloo): one schema whose compile takes seconds, sent first, then
  ``--fast`` small ones; the time until the fast ones have all finished
  (slowest rank, median over rounds), gramcoord's async compile against the
  compile vLLM forces inline under this launcher (target: >= 5x sooner).
- ``start`` (``_vllm_start``): an offline ``LLM(...)`` and the OpenAI
  server (spawn to ``/health`` 200) started with each backend, alternated
  ABBA over ``--start-rounds`` rounds; the baseline is vLLM without the
  plugin (target: gramcoord within 10%, ratio >= 0.909). Not in the
  default parts: each start is a fresh engine (a minute on a busy 2-core
  machine), so ask for it: ``--parts start``.

Ratios are baseline / ours: higher is better. ``--quick`` is a smoke run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

from gramcoord.benchmarks._contract import BenchRecord
from gramcoord.benchmarks._vllm_records import hol_records, load_json, step_records

NOT_INSTALLED = (
    "gramcoord bench vllm needs vLLM 0.32 in this environment (not importable here); "
    "run `make venv-vllm`, then `.venv-vllm/bin/gramcoord bench vllm`"
)
BACKENDS = ("xgrammar", "gramcoord")
QUICK = [
    "--requests",
    "4",
    "--max-tokens",
    "8",
    "--repeat",
    "1",
    "--fast",
    "3",
    "--hol-repeat",
    "1",
    "--start-rounds",
    "1",
]
PARTS = ("step", "hol", "start")


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _parse(args: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gramcoord bench vllm", description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="step,hol", help="comma-separated: step, hol, start")
    p.add_argument("--requests", type=int, default=16, help="constrained requests per step round")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=5, help="measured step rounds per phase")
    p.add_argument("--fast", type=int, default=8, help="fast requests beside the slow one")
    p.add_argument("--hol-repeat", type=int, default=2, help="measured head-of-line rounds")
    p.add_argument("--start-rounds", type=int, default=2, help="start rounds (ABBA pairs)")
    p.add_argument("--quick", action="store_true", help="smallest sizes: a smoke run")
    p.add_argument(
        "--workdir", type=Path, help="model, caches and child logs (default: a temp dir)"
    )
    p.add_argument("--timeout-s", type=float, default=600.0, help="deadline of each child")
    p.add_argument("--data", default=None, help="folder of schemas-dev.jsonl")
    opts = p.parse_args(args)
    if opts.quick:
        opts = p.parse_args([*args, *QUICK])
    return opts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], log: Path, timeout_s: float) -> None:
    from gramcoord.benchmarks._all import run_child

    rc, wall = run_child(cmd, log, timeout_s)
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        why = f"timed out after {timeout_s:.0f} s" if rc is None else f"exit {rc}"
        raise SystemExit(f"bench vllm: {log.stem} {why} after {wall:.0f} s; {log}:\n{tail}")
    print(f"bench vllm: {log.parent.name}/{log.name} done in {wall:.0f} s", flush=True)


def _common(opts: argparse.Namespace, model: Path, work: Path) -> list[str]:
    out = ["--model", str(model), "--max-tokens", str(opts.max_tokens)]
    out += ["--cache-root", str(work / "vllm-cache")]
    return out + (["--data", opts.data] if opts.data else [])


def _step(opts: argparse.Namespace, model: Path, work: Path) -> list[BenchRecord]:
    got = {}
    for backend in BACKENDS:
        out = work / f"step-{backend}.json"
        cmd = [sys.executable, "-m", "gramcoord.benchmarks._vllm_child", "step"]
        cmd += ["--backend", backend]
        cmd += [*_common(opts, model, work), "--out", str(out)]
        cmd += ["--requests", str(opts.requests), "--repeat", str(opts.repeat)]
        _run(cmd, work / f"step-{backend}.log", opts.timeout_s)
        got[backend] = load_json(out)
    return step_records(got["xgrammar"], got["gramcoord"])


def _hol(opts: argparse.Namespace, model: Path, work: Path) -> list[BenchRecord]:
    got = {}
    for backend in BACKENDS:
        out_dir = work / f"hol-{backend}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
        cmd += ["--log-dir", str(work / f"hol-{backend}.torchrun")]
        cmd += ["-m", "gramcoord.benchmarks._vllm_child", "hol", "--backend", backend]
        cmd += [*_common(opts, model, work), "--out-dir", str(out_dir)]
        cmd += ["--fast", str(opts.fast), "--repeat", str(opts.hol_repeat)]
        _run(cmd, work / f"hol-{backend}.log", opts.timeout_s)
        got[backend] = [load_json(out_dir / f"rank{r}.json") for r in range(2)]
    return hol_records(got["xgrammar"], got["gramcoord"])


def run(args: list[str]) -> list[BenchRecord]:
    opts = _parse(args)
    if not vllm_available():
        raise SystemExit(NOT_INSTALLED)
    from gramcoord.benchmarks._vllm_common import build_tiny_vllm_model

    parts = {p.strip() for p in opts.parts.split(",") if p.strip()}
    unknown = parts - set(PARTS)
    if unknown:
        raise SystemExit(f"--parts: unknown {', '.join(sorted(unknown))}; use {', '.join(PARTS)}")
    work = opts.workdir or Path(tempfile.mkdtemp(prefix="gramcoord-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model = build_tiny_vllm_model(work / "model")
    records: list[BenchRecord] = []
    if "step" in parts:
        records += _step(opts, model, work)
    if "hol" in parts:
        records += _hol(opts, model, work)
    if "start" in parts:
        from gramcoord.benchmarks._vllm_start import measure, start_records

        got = measure(model, work, opts.start_rounds, opts.timeout_s)
        (work / "start.json").write_text(json.dumps(got, indent=1))
        records += start_records(got)
    print(f"bench vllm: children's logs and JSON in {work}")
    return records
