"""Child of ``gramcoord bench vllm``: head-of-line blocking under vLLM's external launcher.

Run by torchrun, one process per TP rank::

    torchrun --nproc-per-node 2 -m gramcoord.benchmarks._vllm_hol \\
        --model DIR --backend B --out-dir DIR

Each rank builds ``LLM(DIR, tensor_parallel_size=2,
distributed_executor_backend="external_launcher")``: one scheduler per TP
rank, where vLLM compiles grammars inline ("async grammar compilation causes
deadlocks"), and gramcoord keeps them async. Per round, every rank submits
the same requests in the same order through ``LLMEngine.add_request``: the
slow schema first (a new grammar each round), then ``--fast`` small ones,
and steps the engine until all finish, recording when each finished,
measured from before the first ``add_request``. One warm-up round, then
``--repeat`` rounds. Writes ``rank{R}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from gramcoord.benchmarks._vllm_common import (
    dev_schemas,
    make_llm,
    params,
    setup_env,
    slow_schema,
)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun ... -m gramcoord.benchmarks._vllm_hol")
    p.add_argument("--model", required=True)
    p.add_argument("--backend", required=True, choices=("xgrammar", "gramcoord"))
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--fast", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--data", default=None)
    p.add_argument("--cache-root", default=None)
    return p.parse_args(argv)


def _round(engine: Any, tag: str, slow: dict, fast: list[dict], max_tokens: int) -> dict:
    """One round: slow first, then the fast ones; when each finished (ms from the start)."""
    done: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    engine.add_request(f"{tag}-slow", "Write the build config.", params(slow, max_tokens))
    for i, schema in enumerate(fast):
        engine.add_request(f"{tag}-fast-{i}", f"Write JSON {i}.", params(schema, max_tokens))
    expected = 1 + len(fast)
    while len(done) < expected:
        for out in engine.step():
            if out.finished and out.request_id not in done:
                done[out.request_id] = (time.perf_counter() - t0) * 1e3
                tokens[out.request_id] = list(out.outputs[0].token_ids)
                reason = out.outputs[0].finish_reason
                assert reason in ("stop", "length"), (out.request_id, reason)
    fast_ms = [ms for rid, ms in done.items() if "-fast-" in rid]
    return {
        "fast_done_ms": max(fast_ms),
        "slow_done_ms": done[f"{tag}-slow"],
        "tokens": {rid.split("-", 1)[1]: t for rid, t in tokens.items()},
    }


def main(argv: list[str]) -> int:
    opts = _parse(argv)
    setup_env(opts.cache_root)
    rank = int(os.environ.get("RANK", "0"))
    llm = make_llm(
        opts.model,
        opts.backend,
        tensor_parallel_size=int(os.environ.get("WORLD_SIZE", "2")),
        distributed_executor_backend="external_launcher",
    )
    engine = llm.llm_engine
    fast = dev_schemas(opts.data, opts.fast)
    rounds = []
    for round_no in range(opts.repeat + 1):
        slow = slow_schema(opts.data, round_no)
        got = _round(engine, f"r{round_no}", slow, fast, opts.max_tokens)
        got["warmup"] = round_no == 0
        rounds.append(got)
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    out = {"rank": rank, "backend": opts.backend, "fast": len(fast), "rounds": rounds}
    (opts.out_dir / f"rank{rank}.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
