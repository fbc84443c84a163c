"""Rank bodies for ``MaskDigests`` over a real gloo TP group (run under ``run_ranks``).

The scheduler, its output and vLLM's ``GrammarOutput`` are plain records
with the fields ``MaskDigests`` reads; no vLLM is imported.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

VOCAB_WORDS = 4  # 128 tokens
REQUESTS = ("a", "b", "c")


def _step(step: int, rank: int, flip_at: tuple[int, int] | None) -> SimpleNamespace:
    """One step's bitmask: three requests, one row each, every row allowing a few tokens."""
    bitmask = np.zeros((len(REQUESTS), VOCAB_WORDS), dtype=np.int32)
    for i in range(len(REQUESTS)):
        bitmask[i, (step + i) % VOCAB_WORDS] = 0b1011 << i
    if flip_at is not None and flip_at == (rank, step):
        from gramcoord.integrations.vllm.tp_digest import flip_one_bit

        flip_one_bit(bitmask[1:2])  # request "b"
    return SimpleNamespace(structured_output_request_ids=list(REQUESTS), grammar_bitmask=bitmask)


def digests_body(rank: int, world: int, flip_at: tuple[int, int] | None, steps: int) -> dict:
    import torch.distributed as dist

    from gramcoord.coordinator.config import DistributedConfig
    from gramcoord.integrations.vllm.tp_digest import MaskDigests

    digests = MaskDigests(dist.group.WORLD, DistributedConfig(tp_check_steps=4), 8)
    requests = {rid: SimpleNamespace(num_output_tokens=0) for rid in REQUESTS}
    scheduler = SimpleNamespace(requests=requests, grammar_compile_error_reqs=set())
    out = SimpleNamespace(scheduled_spec_decode_tokens={})
    failed_at = None
    for step in range(steps):
        digests.observe(scheduler, out, None)  # a step with no structured rows
        digests.observe(scheduler, out, _step(step, rank, flip_at))
        if scheduler.grammar_compile_error_reqs and failed_at is None:
            failed_at = step
            for rid in scheduler.grammar_compile_error_reqs:
                requests.pop(rid)  # vLLM finishes it in update_from_output
        for r in requests.values():
            r.num_output_tokens += 1
    return {
        "mismatches": [tuple(m) for m in digests.mismatches],
        "failed": sorted(digests.failed),
        "codes": sorted(code.name for code, _ in digests.failed.values()),
        "failed_at": failed_at,
        "steps": digests.steps,
    }
