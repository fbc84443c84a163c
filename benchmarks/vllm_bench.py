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
  ``sample_tokens`` and within it ``apply_grammar_bitmask``, ...); the two
  engines' plain steps side by side, and gramcoord's per-step hook
  (``before_schedule``) on plain and on constrained steps.
- ``hol`` (``_vllm_child hol``, ``torchrun --nproc-per-node 2``, TP=2, external
  launcher, gloo): one schema whose compile takes seconds, sent first, then
  ``--fast`` small ones; the time until the fast ones have all finished
  (slowest rank, median over rounds), gramcoord's async compile against the
  compile vLLM forces inline under this launcher (target: >= 5x sooner).
  ``--hol-cores``: ``shared`` (every thread may use both cores) and
  ``split`` (the free-core figure: each engine, every thread, on CPU 0;
  gramcoord's compiles on CPU 1 beside the decode; vLLM's inline compile,
  which stops its engine, on both), each a pair of torchrun jobs.
- ``start`` (``_vllm_start``): an offline ``LLM(...)`` and the OpenAI
  server (spawn to ``/health`` 200) started with each backend, alternated
  ABBA over ``--start-rounds`` rounds; the baseline is vLLM without the
  plugin (target: gramcoord within 10%, ratio >= 0.909). Not in the
  default parts: each start is a fresh engine (a minute on a busy 2-core
  machine), so ask for it: ``--parts start``.
- ``bill`` (``_vllm_bill``): what one big schema costs a user: streamed
  TTFT on the OpenAI server, cold, warm (a cache hit) and after a restart
  (gramcoord with its spec store), and offline, constrained throughput and
  the mixing radius of one constrained request in a batch of 64; the
  baseline is vLLM without the plugin. Not in the default parts either:
  ``--parts bill``.

Both backends' children of the step and hol parts run at once and take turns, one round
each (``_vllm_turns``): load that drifts over the run falls on both alike.

Ratios are baseline / ours: higher is better. ``--quick`` is a smoke run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

from gramcoord.benchmarks._contract import BenchRecord
from gramcoord.benchmarks._vllm_records import hol_records, load_json, step_records
from gramcoord.benchmarks._vllm_turns import Child, ChildFailed, run_in_turns
from gramcoord.launch.ports import free_port

NOT_INSTALLED = (
    "gramcoord bench vllm needs vLLM 0.32 in this environment (not importable here); "
    "run `make venv-vllm`, then `.venv-vllm/bin/gramcoord bench vllm`"
)
BACKENDS = ("xgrammar", "gramcoord")
QUICK = shlex.split(
    "--requests 4 --max-tokens 8 --repeat 1 --fast 3 --hol-repeat 1 --start-rounds 1 "
    "--bill-rounds 1 --bill-repeats 1 --bill-properties 50 --bill-requests 4 --bill-tokens 8"
)
PARTS = ("step", "hol", "start", "bill")


def _parse(args: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gramcoord bench vllm", description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="step,hol", help="comma-separated: step, hol, start, bill")
    p.add_argument("--requests", type=int, default=16, help="constrained requests per step round")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=5, help="measured step rounds per phase")
    p.add_argument("--fast", type=int, default=8, help="fast requests beside the slow one")
    p.add_argument("--hol-repeat", type=int, default=2, help="measured head-of-line rounds")
    p.add_argument("--start-rounds", type=int, default=2, help="start rounds (ABBA pairs)")
    p.add_argument("--bill-rounds", type=int, default=3, help="bill rounds (ABBA)")
    p.add_argument("--bill-repeats", type=int, default=5, help="warm requests and decode repeats")
    p.add_argument("--bill-properties", type=int, default=500, help="the big schema's size")
    p.add_argument("--bill-requests", type=int, default=32, help="throughput requests")
    p.add_argument("--bill-tokens", type=int, default=64, help="tokens per offline request")
    p.add_argument(
        "--hol-cores",
        default="shared,split",
        help="comma-separated: shared (every thread on both cores), split (decode on CPU 0, "
        "compiles may use CPU 1)",
    )
    p.add_argument("--quick", action="store_true", help="smallest sizes: a smoke run")
    p.add_argument(
        "--workdir", type=Path, help="model, caches and child logs (default: a temp dir)"
    )
    p.add_argument("--timeout-s", type=float, default=600.0, help="deadline of each child")
    p.add_argument("--data", default=None, help="folder of schemas-dev.jsonl")
    opts = p.parse_args(args)
    return p.parse_args([*args, *QUICK]) if opts.quick else opts


def _common(opts: argparse.Namespace, model: Path, work: Path) -> list[str]:
    out = ["--model", str(model), "--max-tokens", str(opts.max_tokens)]
    # vLLM's cache: the user's own where VLLM_CACHE_ROOT is set (a child
    # whose cache lacks the model's entry inspects the model class in a
    # subprocess that imports vLLM again, about 13 CPU-s), else the workdir's.
    cache = os.environ.get("VLLM_CACHE_ROOT") or str(work / "vllm-cache")
    out += ["--cache-root", cache]
    return out + (["--data", opts.data] if opts.data else [])


def _step(opts: argparse.Namespace, model: Path, work: Path) -> list[BenchRecord]:
    children = []
    for backend in BACKENDS:
        cmd = [sys.executable, "-m", "gramcoord.benchmarks._vllm_child", "step"]
        cmd += ["--backend", backend, "--turns", str(work / "step-turns")]
        cmd += [*_common(opts, model, work), "--out", str(work / f"step-{backend}.json")]
        cmd += ["--requests", str(opts.requests), "--repeat", str(opts.repeat)]
        children.append(Child(backend, cmd, work / f"step-{backend}.log"))
    _in_turns(children, opts.repeat + 1, work / "step-turns", opts.timeout_s)
    got = {b: load_json(work / f"step-{b}.json") for b in BACKENDS}
    return step_records(got["xgrammar"], got["gramcoord"])


# Where each side's engine and compiles run, per --hol-cores arrangement:
# (engine CPUs, compile CPUs of vLLM's xgrammar backend, of gramcoord).
# "split": both engines decode on CPU 0 alone; gramcoord's compile threads get
# CPU 1, beside the decode. vLLM's inline compile stops its engine while it
# runs, so it may use both CPUs: the baseline is never given less than it has.
CORES = {"shared": (None, None, None), "split": ("0", "0,1", "1")}


def _hol(opts: argparse.Namespace, model: Path, work: Path, cores: str) -> list[BenchRecord]:
    engine_cpus, *compile_cpus = CORES[cores]
    children = []
    turns = work / f"hol-{cores}-turns"
    for backend, cpus in zip(BACKENDS, compile_cpus):
        name = f"hol-{cores}-{backend}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
        cmd += ["--log-dir", str(work / f"{name}.torchrun")]
        cmd += ["-m", "gramcoord.benchmarks._vllm_child", "hol", "--backend", backend]
        cmd += [*_common(opts, model, work), "--out-dir", str(work / name)]
        cmd += ["--fast", str(opts.fast), "--repeat", str(opts.hol_repeat), "--turns", str(turns)]
        if engine_cpus is not None:
            cmd += ["--cpus", engine_cpus, "--compile-cpus", cpus]
        children.append(Child(name, cmd, work / f"{name}.log", ranks=2))
    _in_turns(children, opts.hol_repeat + 1, turns, opts.timeout_s)
    got = {
        b: [load_json(work / f"hol-{cores}-{b}" / f"rank{r}.json") for r in range(2)]
        for b in BACKENDS
    }
    return hol_records(got["xgrammar"], got["gramcoord"], free_core=cores == "split")


def _in_turns(children: list[Child], rounds: int, folder: Path, timeout_s: float) -> None:
    """Both backends' children at once, their rounds alternated (``_vllm_turns``)."""
    try:
        wall = run_in_turns(children, rounds, folder, timeout_s * len(children))
    except ChildFailed as exc:
        raise SystemExit(f"bench vllm: {exc}") from None
    names = ", ".join(c.log.name for c in children)
    print(f"bench vllm: {names} done in {wall:.0f} s (rounds in turns)", flush=True)


def _names(text: str, known, option: str) -> list[str]:
    """A comma-separated option's names; an unknown one (or none) exits."""
    got = [c.strip() for c in text.split(",") if c.strip()]
    unknown = sorted(set(got) - set(known))
    if unknown or not got:
        raise SystemExit(
            f"{option}: unknown {', '.join(unknown) or '(none)'}; use {', '.join(known)}"
        )
    return got


def run(args: list[str]) -> list[BenchRecord]:
    opts = _parse(args)
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit(NOT_INSTALLED)
    from gramcoord.benchmarks._vllm_common import build_tiny_vllm_model

    parts = _names(opts.parts, PARTS, "--parts")
    hol_cores = _names(opts.hol_cores, CORES, "--hol-cores") if "hol" in parts else []
    if "split" in hol_cores and not {0, 1} <= os.sched_getaffinity(0):
        raise SystemExit("--hol-cores split needs CPUs 0 and 1")
    work = opts.workdir or Path(tempfile.mkdtemp(prefix="gramcoord-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model = build_tiny_vllm_model(work / "model")
    records: list[BenchRecord] = []
    if "step" in parts:
        records += _step(opts, model, work)
    if "hol" in parts:
        for cores in hol_cores:
            records += _hol(opts, model, work, cores)
    if "start" in parts:
        from gramcoord.benchmarks._vllm_start import measure, start_records

        got = measure(model, work, opts.start_rounds, opts.timeout_s)
        (work / "start.json").write_text(json.dumps(got, indent=1))
        records += start_records(got)
    if "bill" in parts:
        from gramcoord.benchmarks import _vllm_bill as bill

        got = bill.measure(model, work, opts)
        (work / "bill.json").write_text(json.dumps(got, indent=1))
        decode = bill.measure_decode(model, work, opts)
        (work / "bill-decode.json").write_text(json.dumps(decode, indent=1))
        records += bill.bill_records(got) + bill.decode_records(decode)
    print(f"bench vllm: children's logs and JSON in {work}")
    return records
