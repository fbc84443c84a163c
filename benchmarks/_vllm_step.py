"""Child of ``gramcoord bench vllm``: one in-process vLLM engine, every step timed.

``python -m gramcoord.benchmarks._vllm_step --model DIR --backend B --out FILE``
builds ``LLM(DIR, structured_outputs_config={"backend": B})`` in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), wraps vLLM's own step functions with
timers (``_vllm_common.TIMED``), and runs the same batch of requests in
rounds: constrained (one JSON schema each) and plain (the same prompts, no
constraint), interleaved, after one warm-up round of each. Every request
decodes exactly ``--max-tokens`` tokens (``ignore_eos``), so each step of a
round has the same batch. Writes JSON: per phase, per timer, every sample
(ms); and the constrained outputs' token ids, to compare backends.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gramcoord.benchmarks._vllm_common import Timers, dev_schemas, make_llm, params, setup_env


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gramcoord.benchmarks._vllm_step")
    p.add_argument("--model", required=True)
    p.add_argument("--backend", required=True, choices=("xgrammar", "gramcoord"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--data", default=None)
    p.add_argument("--cache-root", default=None)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    opts = _parse(argv)
    setup_env(opts.cache_root)
    timers = Timers()
    timers.install()
    llm = make_llm(opts.model, opts.backend)
    schemas = dev_schemas(opts.data, opts.requests)
    prompts = [f"Write JSON for record {i}." for i in range(len(schemas))]
    constrained = [params(s, opts.max_tokens) for s in schemas]
    plain = [params(None, opts.max_tokens) for _ in schemas]
    samples: dict[str, dict[str, list[float]]] = {"constrained": {}, "plain": {}}
    outputs: list[list[int]] = []
    for round_no in range(opts.repeat + 1):
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
    result: dict[str, Any] = {
        "backend": opts.backend,
        "requests": len(schemas),
        "max_tokens": opts.max_tokens,
        "repeat": opts.repeat,
        "samples": samples,
        "outputs": outputs,
    }
    opts.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
