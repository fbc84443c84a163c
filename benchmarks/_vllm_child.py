"""The children of ``gramcoord bench vllm``: real vLLM engines, timed from inside.

``python -m gramcoord.benchmarks._vllm_child step --model DIR --backend B --out FILE``
builds ``LLM(DIR, structured_outputs_config={"backend": B})`` in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), wraps vLLM's own step functions with
timers (``_vllm_common.TIMED``), and runs the same batch of requests in
rounds: constrained (one JSON schema each) and plain (the same prompts, no
constraint), interleaved, after one warm-up round of each. Every request
decodes exactly ``--max-tokens`` tokens (``ignore_eos``), so each step of a
round has the same batch. With gramcoord, its per-step hook
(``VllmBackend.before_schedule``) is timed too (``hook``). Writes JSON:
per phase, per timer, every sample (ms); and the constrained outputs' token
ids, to compare backends. With ``--turns DIR`` each round waits for its turn
(``_vllm_turns``): the parent alternates the two backends' rounds.

``torchrun --nproc-per-node 2 -m gramcoord.benchmarks._vllm_child hol --model
DIR --backend B --out-dir DIR``: each rank builds ``LLM(DIR,
tensor_parallel_size=2, distributed_executor_backend="external_launcher")``:
one scheduler per TP rank, where vLLM compiles grammars inline ("async
grammar compilation causes deadlocks"), and gramcoord keeps them async. Per
round, every rank submits the same requests in the same order through
``LLMEngine.add_request``: the slow schema first (a new grammar each round),
then ``--fast`` small ones, and steps the engine until all finish, recording
when each finished and when each got its first token, from before the first
``add_request``. One warm-up round (one fast request alone, so that the
one-token batch vLLM's torch.compile specializes is compiled too, then all
of them), then
``--repeat`` rounds, in turns with ``--turns``. Writes ``rank{R}.json``.
``--cpus 0`` pins the whole engine (every thread it starts) to CPU 0;
``--compile-cpus`` runs each xgrammar compile call on the CPUs given
(``_vllm_common.pin_compiles``): the benchmark's free-core arrangement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gramcoord.benchmarks._vllm_common import (
    Timers,
    dev_schemas,
    make_llm,
    own_shm_names,
    params,
    pin_compiles,
    setup_env,
    slow_schema,
)
from gramcoord.benchmarks._vllm_turns import parse_cpus, turn


def _parser(prog: str) -> argparse.ArgumentParser:
    """The options both children take."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--model", required=True)
    p.add_argument("--backend", required=True, choices=("xgrammar", "gramcoord"))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--data", default=None)
    p.add_argument("--cache-root", default=None)
    p.add_argument("--turns", type=Path, default=None, help="take rounds in turns (_vllm_turns)")
    return p


def _parse_step(argv: list[str]) -> argparse.Namespace:
    p = _parser("python -m gramcoord.benchmarks._vllm_child step")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    return p.parse_args(argv)


def _time_hook(timers: Timers) -> None:
    """Time gramcoord's per-step hook (``before_schedule``: the agreement) as ``hook``."""
    from gramcoord.integrations.vllm.backend import VllmBackend

    timers.wrap(VllmBackend, "before_schedule", "hook")


def _time_digests(timers: Timers) -> None:
    """Time the TP mask digests (``MaskDigests.observe``, after each bitmask) as ``digest``."""
    from gramcoord.integrations.vllm.tp_digest import MaskDigests

    timers.wrap(MaskDigests, "observe", "digest")


def step_main(argv: list[str]) -> int:
    opts = _parse_step(argv)
    setup_env(opts.cache_root)
    timers = Timers()
    timers.install()
    if opts.backend == "gramcoord":
        _time_hook(timers)
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
                timers.reset()
                got = llm.generate(prompts, sampling, use_tqdm=False)
                if round_no == 0:  # warm-up: compiles, first-step costs
                    if phase == "constrained":
                        outputs = [list(o.outputs[0].token_ids) for o in got]
                        errors = [o.outputs[0].finish_reason for o in got]
                        assert all(e in ("stop", "length") for e in errors), errors
                    continue
                for label, ms in timers.snapshot().items():
                    samples[phase].setdefault(label, []).extend(ms)
                per_round[phase].append(statistics.median(timers.samples["step"]))
    result: dict[str, Any] = {
        "backend": opts.backend,
        "requests": len(schemas),
        "max_tokens": opts.max_tokens,
        "repeat": opts.repeat,
        "samples": samples,
        "round_step_ms": per_round,
        "outputs": outputs,
    }
    opts.out.write_text(json.dumps(result))
    return 0


def _parse_hol(argv: list[str]) -> argparse.Namespace:
    p = _parser("torchrun ... -m gramcoord.benchmarks._vllm_child hol")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--fast", type=int, default=8)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--cpus", default=None, help="pin the engine (every thread) to these CPUs")
    p.add_argument(
        "--compile-cpus", default=None, help="run each xgrammar compile call on these CPUs"
    )
    return p.parse_args(argv)


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
    t0 = time.perf_counter()
    if slow is not None:
        engine.add_request(f"{tag}-slow", "Write the build config.", params(slow, max_tokens))
    for i, schema in enumerate(fast):
        engine.add_request(f"{tag}-fast-{i}", f"Write JSON {i}.", params(schema, max_tokens))
    expected = len(fast) + (slow is not None)
    first: dict[str, float] = {}
    steps = 0
    step_log: list[tuple[float, float, float, float, int]] = []
    while len(done) < expected:
        timers.reset()
        digested = _digested_steps(engine)
        t_step = time.perf_counter()
        outs = engine.step()
        steps += 1
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
    fast_ms = [ms for rid, ms in done.items() if "-fast-" in rid]
    fast_first = [ms for rid, ms in first.items() if "-fast-" in rid]
    return {
        "fast_done_ms": max(fast_ms),
        # When the last fast request got its first token (admitted and decoding).
        "fast_first_token_ms": max(fast_first),
        "steps": steps,
        "step_log": step_log,
        "slow_done_ms": done.get(f"{tag}-slow", 0.0),
        "tokens": {rid.split("-", 1)[1]: t for rid, t in tokens.items()},
    }


def hol_main(argv: list[str]) -> int:
    opts = _parse_hol(argv)
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
        _time_hook(timers)
        _time_digests(timers)
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
        got["warmup"] = round_no == 0
        rounds.append(got)
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    out = {
        "rank": rank,
        "backend": opts.backend,
        "fast": len(fast),
        "cpus": opts.cpus,
        "compile_cpus": opts.compile_cpus,
        "rounds": rounds,
    }
    (opts.out_dir / f"rank{rank}.json").write_text(json.dumps(out))
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("step", "hol"):
        raise SystemExit("usage: python -m gramcoord.benchmarks._vllm_child {step,hol} ...")
    return (step_main if argv[0] == "step" else hol_main)(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
