"""One replica of the DP=2 external-launcher run (``torchrun --nproc-per-node 2``).

Usage: ``dp_driver.py MODEL_DIR OUT_DIR``. vLLM's own data-parallel mode
under ``external_launcher``: each torchrun process is one replica with its
own engine, scheduler and grammar manager, and vLLM's DP group between them.
Three phases, each run to the end of ``LLM``-style stepping on both replicas
(vLLM keeps an idle replica stepping with dummy batches):

1. replica 0 gets the poisoned schema; its compile is held past
   ``compile_timeout_s`` (the ``compile_delay`` fault), so it fails with
   ``grammar_timeout``. Replica 1 decodes a plain request meanwhile.
2. both replicas decode a plain request: vLLM's per-step DP collective runs
   the poison exchange past its lag.
3. replica 1 gets the same schema: it must fail at once, with replica 0's
   code and message, without compiling it.

Writes ``replica<R>.json``: per request its finish reason and token count,
the code and message our backend refused it with, and the specs this
replica compiled (their text).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

POISON_MARK = "poison_me_across_replicas"
POISONED = {
    "type": "object",
    "properties": {POISON_MARK: {"type": "integer"}},
    "required": [POISON_MARK],
}
PLAIN = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def _record(rank: int, refused: dict[str, list[str]], compiled: list[str]) -> None:
    from gramcoord.integrations.vllm.backend import VllmBackend

    compile_spec = VllmBackend._compile_spec
    refuse = VllmBackend._refused

    def counted(self, spec):
        compiled.append(spec.text)
        return compile_spec(self, spec)

    def refused_with(self, outcome):
        # vLLM's internal id: the caller's, plus "-" and a random suffix.
        refused[outcome.request_id.rsplit("-", 1)[0]] = [outcome.code, outcome.message]
        return refuse(self, outcome)

    VllmBackend._compile_spec = counted
    VllmBackend._refused = refused_with


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    from gramcoord.integrations.vllm.plugin import register

    register()
    refused: dict[str, list[str]] = {}
    compiled: list[str] = []
    _record(rank, refused, compiled)
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from gramcoord.benchmarks._vllm_common import ENGINE_KW

    gramcoord = {
        "grammar": {"compile_timeout_s": 3.0, "compile_wall_timeout_s": 3600.0},
        "faults": {
            "compile_delay": {"pattern": POISON_MARK, "rank": 0, "seconds": 30.0, "times": 0}
        },
    }
    llm = LLM(
        model,
        structured_outputs_config={"backend": "gramcoord"},
        distributed_executor_backend="external_launcher",
        data_parallel_size=2,
        additional_config={"gramcoord": gramcoord},
        **ENGINE_KW,
    )
    engine = llm.llm_engine
    result: dict[str, dict] = {}
    started: dict[str, float] = {}

    def run(rid: str, schema: dict, max_tokens: int) -> None:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            structured_outputs=StructuredOutputsParams(json=schema),
        )
        started[rid] = time.monotonic()
        engine.add_request(rid, "Give JSON:", params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    result[o.request_id] = {
                        "reason": o.outputs[0].finish_reason,
                        "tokens": len(o.outputs[0].token_ids),
                        "seconds": round(time.monotonic() - started[o.request_id], 3),
                    }

    run("learn" if rank == 0 else "beside-learn", POISONED if rank == 0 else PLAIN, 8)
    run(f"filler{rank}", PLAIN, 12)
    run("meet" if rank == 1 else "beside-meet", POISONED if rank == 1 else PLAIN, 8)
    result["_refused"] = refused  # type: ignore[assignment]
    result["_compiled"] = compiled  # type: ignore[assignment]
    (out / f"replica{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
