"""One rank of the TP=2 external-launcher run (``torchrun --nproc-per-node 2``).

Usage: ``tp_driver.py MODEL_DIR REQUESTS_JSON OUT_DIR``. Every rank adds the
same requests, steps the engine itself and writes ``rank<R>.json``: per
request its tokens, finish reason, and the engine steps of its first output
and of its end. Wall times, which differ between ranks, go to
``rank<R>.times.json``; the modules of ours the process loaded, to
``rank<R>.modules.json``.

Two faults are injected here, into the backend's compile function, by the
test's environment:

- ``GATE_MARK``: a spec whose text contains it compiles for real, then waits
  until this rank has finished every request of its batch without that mark
  (or ``GATE_S`` passed: ``gate_timed_out`` is recorded, and also when no
  gated compile ran). Were any rank's
  fast requests held up by the slow compile, they would not finish and the
  gate would time out.
- ``FAIL_MARK`` (``RANK:TEXT``): on that rank, a spec containing ``TEXT``
  fails to compile.

and one into the TP mask digests:

- ``FLIP`` (``RANK:REQUEST:POSITION``): on that rank, the bitmask row of
  that request at that output position loses one allowed token before it
  is digested and applied (``tp_digest.flip_one_bit``): the ranks' masks
  differ, and the digests must catch it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

GATE_S = 240.0


def _inject(rank: int, gate: threading.Event, held: dict[str, bool]) -> None:
    from gramcoord.integrations.vllm.backend import VllmBackend

    gate_mark = os.environ.get("GATE_MARK", "")
    fail_rank, _, fail_mark = os.environ.get("FAIL_MARK", "").partition(":")
    compile_spec = VllmBackend._compile_spec

    def injected(self, spec):
        if fail_mark and int(fail_rank) == rank and fail_mark in spec.text:
            raise RuntimeError(f"injected compile failure on rank {rank}")
        compiled = compile_spec(self, spec)
        if gate_mark and gate_mark in spec.text:
            held["gate_timed_out"] = not gate.wait(GATE_S)
        return compiled

    VllmBackend._compile_spec = injected
    flip_rank, flip_rid, flip_pos = (os.environ.get("FLIP", "") or "-1::0").split(":")
    if int(flip_rank) != rank:
        return
    from gramcoord.integrations.vllm.tp_digest import MaskDigests, flip_one_bit, row_digests

    observe = MaskDigests.observe

    def flipped(self, scheduler, scheduler_output, grammar_output):
        if grammar_output is not None:
            digests = row_digests(grammar_output.grammar_bitmask)
            rows = self._positions(scheduler, scheduler_output, grammar_output, digests)
            for i, (rid, pos, _) in enumerate(rows):
                # vLLM's internal id: the caller's, plus "-" and a random suffix.
                if rid.rsplit("-", 1)[0] == flip_rid and pos == int(flip_pos):
                    held["flipped_row"] = flip_one_bit(grammar_output.grammar_bitmask[i : i + 1])
        return observe(self, scheduler, scheduler_output, grammar_output)

    MaskDigests.observe = flipped


def main() -> None:
    model, requests_path, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    rank = int(os.environ["RANK"])
    from gramcoord.integrations.vllm.plugin import register

    register()
    gate = threading.Event()
    held: dict[str, bool] = {}
    _inject(rank, gate, held)
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from gramcoord.benchmarks._vllm_common import ENGINE_KW
    from tests.integrations.vllm.tiny_model import COMPILE_DEADLINE

    # Ours the driver loaded itself (its engine arguments), before the engine.
    harness = sorted(m for m in sys.modules if m.startswith("gramcoord."))
    grammar: dict = dict(COMPILE_DEADLINE)
    if os.environ.get("STORE_DIR"):  # a spec store, warm before the first request
        grammar["store"] = {"dir": os.environ["STORE_DIR"], "ready_wait_s": 300}
    llm = LLM(
        model,
        structured_outputs_config={"backend": "gramcoord"},
        distributed_executor_backend="external_launcher",
        tensor_parallel_size=2,
        additional_config={"gramcoord": {"grammar": grammar}},
        **ENGINE_KW,
    )
    engine = llm.llm_engine
    gate_mark = os.environ.get("GATE_MARK", "")
    result: dict[str, dict] = {}
    times: dict[str, float] = {}
    t0 = time.monotonic()
    for batch in json.loads(requests_path.read_text()):
        ungated: set[str] = set()
        for r in batch:
            params = SamplingParams(
                temperature=0.0,
                max_tokens=r["max_tokens"],
                ignore_eos=r.get("ignore_eos", False),
                structured_outputs=StructuredOutputsParams(json=r["schema"]),
            )
            engine.add_request(r["id"], r["prompt"], params)
            if not gate_mark or gate_mark not in json.dumps(r["schema"]):
                ungated.add(r["id"])
        first: dict[str, int] = {}
        step = 0
        while engine.has_unfinished_requests():
            step += 1
            for o in engine.step():
                first.setdefault(o.request_id, step)
                if o.finished:
                    c = o.outputs[0]
                    times[o.request_id] = round(time.monotonic() - t0, 3)
                    result[o.request_id] = {
                        "tokens": list(c.token_ids),
                        "reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                        "step": step,
                        "first_step": first[o.request_id],
                    }
            if ungated and ungated <= result.keys() and not gate.is_set():
                times["gate_released"] = round(time.monotonic() - t0, 3)
                gate.set()
    times["gate_timed_out"] = held.get("gate_timed_out", bool(gate_mark))
    scheduler = engine.engine_core.engine_core.scheduler
    backend = scheduler.structured_output_manager.backend
    result["_stats"] = {
        "num_live": backend.num_live,
        "group_size": backend.grammars.group_size,
        "collectives": backend.grammars.num_collectives,
        "async": scheduler.structured_output_manager._use_async_grammar_compilation,
        "mismatches": [
            [m.step, list(m.ranks), m.request_id.rsplit("-", 1)[0], m.position]
            for m in backend.digests.mismatches
        ],
        "digested_steps": backend.digests.steps,
        # Requests that joined a warm-start compile of the spec store.
        "warm": backend.grammars.leader._manager.stats.warm,
    }
    times["flipped"] = held.get("flipped_row") is not None
    times["digest_s"] = backend.digests.seconds
    times["engine_s"] = round(time.monotonic() - t0, 3)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    (out / f"rank{rank}.times.json").write_text(json.dumps(times))
    # What this engine process loaded of ours, after its requests ran.
    ours = sorted(m for m in sys.modules if m.startswith("gramcoord."))
    loaded = {"harness": harness, "after": ours}
    (out / f"rank{rank}.modules.json").write_text(json.dumps(loaded))


if __name__ == "__main__":
    main()
