"""The children of ``gramcoord bench vllm`` (``vllm_bench.py``): real vLLM engines, timed inside.

``python -m gramcoord.benchmarks._vllm_child step --model DIR --backend B --out FILE``
builds ``LLM(DIR, structured_outputs_config={"backend": B})`` in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), wraps vLLM's own step functions with
timers (``TIMED``; they change nothing else) and runs the same batch in
rounds, constrained (one JSON schema per request) and plain (no
constraint) interleaved, after one warm-up round of each; every request
decodes exactly ``--max-tokens`` tokens (``ignore_eos``). With gramcoord its
per-step hook (``VllmBackend.before_schedule``) is timed too. Writes every
sample (ms) per phase and timer, and the constrained outputs' token ids.

``torchrun --nproc-per-node 2 -m gramcoord.benchmarks._vllm_child hol ...
--out-dir DIR``: each rank builds a TP=2 ``LLM`` under the external
launcher, where vLLM compiles grammars inline and gramcoord keeps them
async. Per round every rank adds the same requests in the same order (the
slow schema, a new grammar each round, then ``--fast`` small ones) and
steps the engine until all finish, logging each step and when each request
got its first token and finished. A warm-up round (one fast request alone,
then all of them), then ``--repeat`` rounds. Writes ``DIR/rank{R}.json``.
``--cpus`` pins the engine (every thread it starts); ``--compile-cpus``
runs each xgrammar compile call on other CPUs (``pin_compiles``): the
free-core arrangement.

With ``--turns DIR`` each round waits for its turn (``_vllm_turns``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from gramcoord.benchmarks._vllm_common import (
    data_dir,
    dev_schemas,
    make_llm,
    params,
    setup_env,
)
from gramcoord.benchmarks._vllm_turns import parse_cpus, turn

# The slow schema of the head-of-line run: about 4.4 s to compile with
# xgrammar 0.2.9 (tests/data/schemas-dev.xgrammar-labels.jsonl), accepted by
# vLLM's xgrammar checks and by gramcoord's.
SLOW_ID = "jsonschemabench/JsonSchemaStore/kode-ci-build-1.0.0"
# (label, module, attribute path) of what the step breakdown times.
TIMED: tuple[tuple[str, str, str], ...] = (
    ("step", "vllm.v1.engine.core", "EngineCore.step"),
    ("schedule", "vllm.v1.core.sched.scheduler", "Scheduler.schedule"),
    ("forward", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model"),
    ("grammar_bitmask", "vllm.v1.core.sched.scheduler", "Scheduler.get_grammar_bitmask"),
    ("sample_tokens", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner.sample_tokens"),
    ("apply_grammar_bitmask", "vllm.v1.worker.gpu_model_runner", "apply_grammar_bitmask"),
    ("update_from_output", "vllm.v1.core.sched.scheduler", "Scheduler.update_from_output"),
)


class Timers:
    """Wall time of each call of the wrapped functions, in ms, per label."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = defaultdict(list)

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.samples[label].append((time.perf_counter() - t0) * 1e3)

        setattr(owner, attr, timed)

    def install(self) -> None:
        """Wrap every function of ``TIMED``."""
        for label, module, path in TIMED:
            owner: Any = importlib.import_module(module)
            *parents, attr = path.split(".")
            for name in parents:
                owner = getattr(owner, name)
            self.wrap(owner, attr, label)

    def time_gramcoord(self, *, digests: bool) -> None:
        """Also time gramcoord's per-step hook (``before_schedule``: the agreement) as
        ``hook``; with ``digests``, the TP mask digests (``MaskDigests.observe``) as
        ``digest``."""
        from gramcoord.integrations.vllm.backend import VllmBackend
        from gramcoord.integrations.vllm.tp_digest import MaskDigests

        self.wrap(VllmBackend, "before_schedule", "hook")
        if digests:
            self.wrap(MaskDigests, "observe", "digest")


def pin_compiles(cpus: set[int]) -> None:
    """Run each of vLLM's xgrammar compile calls on ``cpus`` (the benchmark's free-core setup).

    Wraps ``XgrammarBackend.compile_grammar``, the call both backends compile
    through (vLLM's inline on the engine's thread, gramcoord's on its compile
    threads): the calling thread gets ``cpus`` for the call, and xgrammar's
    own threads, started inside it, inherit them.
    """
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    fn = XgrammarBackend.compile_grammar

    @functools.wraps(fn)
    def pinned(*args: Any, **kwargs: Any) -> Any:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cpus)
        try:
            return fn(*args, **kwargs)
        finally:
            os.sched_setaffinity(0, before)

    XgrammarBackend.compile_grammar = pinned


def own_shm_names(tag: str) -> None:
    """Give this TP job's CPU shared-memory segments names of its own (``tag``).

    vLLM's CPU communicator names them after ``VLLM_DIST_IDENT``, which under
    the external launcher is the same for every job (``env://``), so a
    second TP job running beside the first fails with ``create shm in
    SHMManager failed. errno: 17``. Only the name changes.
    """
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    name = _CPUSHMDistributed.make_group_name
    _CPUSHMDistributed.make_group_name = staticmethod(lambda comm: f"{name(comm)}-{tag}")


def _renamed(node: Any, tag: str) -> Any:
    """``node`` with ``tag`` appended to every property name (and its ``required`` entry)."""
    if isinstance(node, list):
        return [_renamed(x, tag) for x in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties" and isinstance(value, dict):
            out[key] = {f"{name}{tag}": _renamed(sub, tag) for name, sub in value.items()}
        elif key == "required" and isinstance(value, list):
            out[key] = [f"{n}{tag}" if isinstance(n, str) else n for n in value]
        elif key in ("enum", "const", "default", "examples"):
            out[key] = value
        else:
            out[key] = _renamed(value, tag)
    return out


def slow_schema(data: str | None, round_no: int) -> dict:
    """The slow schema as a new grammar per round: every property name gets a round tag.

    A smaller change is not enough: xgrammar's compiler caches below the
    whole grammar, and one added property compiled in 0.09 s after a 15 s
    first compile (0.2.8, here); with every name renamed each compile is
    cold on both backends.
    """
    root = data_dir(data)
    for line in (root / "schemas-dev.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["id"] == SLOW_ID:
            return _renamed(rec["schema"], f"_r{round_no}")
    raise SystemExit(f"{SLOW_ID} is not in {root}/schemas-dev.jsonl")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gramcoord.benchmarks._vllm_child")
    p.add_argument("part", choices=("step", "hol"))
    p.add_argument("--model", required=True)
    p.add_argument("--backend", required=True, choices=("xgrammar", "gramcoord"))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--data", default=None)
    p.add_argument("--cache-root", default=None)
    p.add_argument("--turns", type=Path, default=None, help="take rounds in turns (_vllm_turns)")
    p.add_argument("--repeat", type=int, default=5, help="measured rounds")
    p.add_argument("--out", type=Path, help="step: the JSON file")
    p.add_argument("--requests", type=int, default=16, help="step: requests per round")
    p.add_argument("--out-dir", type=Path, help="hol: the folder of rank{R}.json")
    p.add_argument("--fast", type=int, default=8, help="hol: fast requests beside the slow one")
    p.add_argument("--cpus", default=None, help="hol: pin the engine (every thread) to these CPUs")
    p.add_argument("--compile-cpus", default=None, help="hol: each xgrammar compile on these CPUs")
    return p.parse_args(argv)


def step_main(opts: argparse.Namespace) -> None:
    setup_env(opts.cache_root)
    timers = Timers()
    timers.install()
    if opts.backend == "gramcoord":
        timers.time_gramcoord(digests=False)
    llm = make_llm(opts.model, opts.backend)
    schemas = dev_schemas(opts.data, opts.requests)
    prompts = [f"Write JSON for record {i}." for i in range(len(schemas))]
    constrained = [params(s, opts.max_tokens) for s in schemas]
    plain = [params(None, opts.max_tokens) for _ in schemas]
    samples: dict[str, dict[str, list[float]]] = {"constrained": {}, "plain": {}}
    # The median step of each measured round, per phase (rounds are alternated
    # with the other backend's: compare them round by round).
    per_round: dict[str, list[float]] = {"constrained": [], "plain": []}
    outputs: list[list[int]] = []
    for round_no in range(opts.repeat + 1):
        with turn(opts.turns, opts.backend, round_no):
            for phase, sampling in (("constrained", constrained), ("plain", plain)):
                timers.samples.clear()
                got = llm.generate(prompts, sampling, use_tqdm=False)
                if round_no == 0:  # warm-up: compiles, first-step costs
                    if phase == "constrained":
                        outputs = [list(o.outputs[0].token_ids) for o in got]
                        errors = [o.outputs[0].finish_reason for o in got]
                        assert all(e in ("stop", "length") for e in errors), errors
                    continue
                for label, ms in timers.samples.items():
                    samples[phase].setdefault(label, []).extend(ms)
                per_round[phase].append(statistics.median(timers.samples["step"]))
    result = {
        "backend": opts.backend,
        "requests": len(schemas),
        "max_tokens": opts.max_tokens,
        "repeat": opts.repeat,
        "samples": samples,
        "round_step_ms": per_round,
        "outputs": outputs,
    }
    opts.out.write_text(json.dumps(result))


def _digested_steps(engine: Any) -> int:
    """Steps the gramcoord backend's TP mask digests took rows in (0 without them)."""
    backend = engine.engine_core.engine_core.scheduler.structured_output_manager.backend
    digests = getattr(backend, "digests", None)
    return digests.steps if digests is not None else 0


def _round(
    engine: Any, tag: str, slow: dict | None, fast: list[dict], max_tokens: int, timers: Timers
) -> dict:
    """One round: slow first (if any), then the fast ones; when each finished (ms from start).

    Each step is logged as (ms from start when it ended, its ms, ms of it in
    gramcoord's hook, ms of it in the TP mask digests, whether the digests
    took in rows this step: 0 with vLLM's backend).
    """
    done: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    first: dict[str, float] = {}
    step_log: list[tuple[float, float, float, float, int]] = []
    t0 = time.perf_counter()
    if slow is not None:
        engine.add_request(f"{tag}-slow", "Write the build config.", params(slow, max_tokens))
    for i, schema in enumerate(fast):
        engine.add_request(f"{tag}-fast-{i}", f"Write JSON {i}.", params(schema, max_tokens))
    while len(done) < len(fast) + (slow is not None):
        timers.samples.clear()
        digested = _digested_steps(engine)
        t_step = time.perf_counter()
        outs = engine.step()
        now = (time.perf_counter() - t0) * 1e3
        hook = sum(timers.samples.get("hook", ()))
        digest = sum(timers.samples.get("digest", ()))
        ms = (time.perf_counter() - t_step) * 1e3
        step_log.append((now, ms, hook, digest, _digested_steps(engine) - digested))
        for out in outs:
            if out.outputs and out.outputs[0].token_ids:
                first.setdefault(out.request_id, now)
            if out.finished and out.request_id not in done:
                done[out.request_id] = (time.perf_counter() - t0) * 1e3
                tokens[out.request_id] = list(out.outputs[0].token_ids)
                reason = out.outputs[0].finish_reason
                assert reason in ("stop", "length"), (out.request_id, reason)
    return {
        "fast_done_ms": max(ms for rid, ms in done.items() if "-fast-" in rid),
        # When the last fast request got its first token (admitted and decoding).
        "fast_first_token_ms": max(ms for rid, ms in first.items() if "-fast-" in rid),
        "steps": len(step_log),
        "step_log": step_log,
        "slow_done_ms": done.get(f"{tag}-slow", 0.0),
        "tokens": {rid.split("-", 1)[1]: t for rid, t in tokens.items()},
    }


def hol_main(opts: argparse.Namespace) -> None:
    if opts.cpus:  # before torch and vLLM start threads: they inherit it
        os.sched_setaffinity(0, parse_cpus(opts.cpus))
    setup_env(opts.cache_root)
    rank = int(os.environ.get("RANK", "0"))
    own_shm_names(f"gramcoord-bench-{os.environ.get('MASTER_PORT', os.getppid())}")
    llm = make_llm(
        opts.model,
        opts.backend,
        tensor_parallel_size=int(os.environ.get("WORLD_SIZE", "2")),
        distributed_executor_backend="external_launcher",
    )
    if opts.compile_cpus:
        pin_compiles(parse_cpus(opts.compile_cpus))
    timers = Timers()
    if opts.backend == "gramcoord":
        timers.time_gramcoord(digests=True)
    engine = llm.llm_engine
    fast = dev_schemas(opts.data, opts.fast)
    rounds = []
    name = opts.out_dir.name  # the parent's name for this child's turns
    for round_no in range(opts.repeat + 1):
        # The warm-up round has no slow request: first-step costs and the fast
        # schemas' compiles (cached after it on both backends).
        slow = slow_schema(opts.data, round_no) if round_no else None
        with turn(opts.turns, name, round_no, rank):
            if not round_no:
                # One request alone first: vLLM's torch.compile of the TP
                # embedding specializes on a batch of one token and compiles
                # again the first time it sees one (seconds of inductor work
                # inside a step), which gramcoord's staggered admissions
                # otherwise met in a measured round.
                _round(engine, "r0-alone", None, fast[:1], opts.max_tokens, timers)
            got = _round(engine, f"r{round_no}", slow, fast, opts.max_tokens, timers)
        rounds.append({**got, "warmup": round_no == 0})
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    out = {"rank": rank, "backend": opts.backend, "fast": len(fast), "rounds": rounds}
    (opts.out_dir / f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    opts = _parse(sys.argv[1:])
    (step_main if opts.part == "step" else hol_main)(opts)
