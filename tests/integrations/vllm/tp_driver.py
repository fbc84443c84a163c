"""One rank of the TP=2 external-launcher run (``torchrun --nproc-per-node 2``).

Usage: ``tp_driver.py MODEL_DIR REQUESTS_JSON OUT_DIR``. Every rank adds the
same requests, steps the engine itself and writes ``rank<R>.json``: per
request its tokens, finish reason and the engine step it finished in.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> None:
    model, requests_path, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    rank = int(os.environ["RANK"])
    from gramcoord.integrations.vllm.plugin import register

    register()
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from tests.integrations.vllm.tiny_model import ENGINE_KW

    llm = LLM(
        model,
        structured_outputs_config={"backend": "gramcoord"},
        distributed_executor_backend="external_launcher",
        tensor_parallel_size=2,
        additional_config={"gramcoord": {"grammar": {"compile_timeout_s": 300}}},
        **ENGINE_KW,
    )
    engine = llm.llm_engine
    result: dict[str, dict] = {}
    for batch in json.loads(requests_path.read_text()):
        for r in batch:
            params = SamplingParams(
                temperature=0.0,
                max_tokens=r["max_tokens"],
                structured_outputs=StructuredOutputsParams(json=r["schema"]),
            )
            engine.add_request(r["id"], r["prompt"], params)
        step = 0
        while engine.has_unfinished_requests():
            step += 1
            for o in engine.step():
                if o.finished:
                    c = o.outputs[0]
                    result[o.request_id] = {
                        "tokens": list(c.token_ids),
                        "reason": c.finish_reason,
                        "step": step,
                    }
    backend = engine.engine_core.engine_core.scheduler.structured_output_manager.backend
    result["_stats"] = {
        "num_live": backend.num_live,
        "group_size": backend.agreement.size,
        "collectives": backend.agreement.num_collectives,
        "async": engine.engine_core.engine_core.scheduler.structured_output_manager._use_async_grammar_compilation,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
