"""Rank bodies for ``test_hf.py``: each runs in a spawned process and returns plain values.

Every rank builds the same tiny random-weight Qwen2 model (seed 0) and the
offline Hugging Face tokenizer over the real Qwen2.5 vocabulary
(``qwen25_hf_tokenizer``), then drives ``GenerateSession`` the way a host
would: ``prepare``, ``generate`` (greedy, ``synced_gpus`` in a world),
``finish``.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from gramcoord.coordinator.config import DistributedConfig, ParallelConfig
from gramcoord.engine.models import build_tiny_qwen2
from gramcoord.integrations.hf.generate import GenerateSession
from gramcoord.integrations.hf.tokenizer import encode_prompts, qwen25_hf_tokenizer
from gramcoord.launch.workload import dev_data_dir
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer
from gramcoord.rank_worker.session.session import RankSession
from gramcoord.rank_worker.session.types import SessionConfig

VOCAB = 151_936
NAME = "qwen2.5-hf"

SENTIMENT = {"choice": ["positive", "negative", "neutral"]}
CAPITAL = {"choice": ["Paris", "London", "Berlin", "Madrid", "Rome"]}
BOOLEAN = {"json": {"type": "boolean"}}
COLOR = {"json": {"enum": ["red", "green", "blue"]}}
GCD = {
    "json": {
        "type": "object",
        "properties": {
            "math.gcd": {
                "type": "object",
                "properties": {"num1": {"type": "integer"}, "num2": {"type": "integer"}},
                "required": ["num1", "num2"],
                "additionalProperties": False,
            }
        },
        "required": ["math.gcd"],
        "additionalProperties": False,
    }
}
CONFGEN = {
    "json": {
        "type": "object",
        "properties": {"templates": {"type": "string"}},
        "required": ["templates"],
    }
}
# configs/workload.jsonl "bad/compile-error-1": valid to the validator, refused
# by xgrammar 0.2.9 at compile time (grammar_invalid), so its key is poisoned.
BAD = {
    "json": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "prefixItems": [True, False],
    }
}
# A dev schema that takes seconds to compile with the real vocabulary
# (tests/data/README.md: about 4.8 s on one thread, more under load).
SLOW_ID = "jsonschemabench/Snowplow/sp_13_Normalized"

# The requests of the DP test, per rank (partitioned streams).
DP_REQUESTS: dict[int, list[tuple[str, dict]]] = {
    0: [("r0-sentiment", SENTIMENT), ("r0-boolean", BOOLEAN), ("r0-gcd", GCD)],
    1: [("r1-capital", CAPITAL), ("r1-color", COLOR), ("r1-confgen", CONFGEN)],
}


def slow_spec() -> dict:
    """The slow dev schema as a ``json`` spec."""
    for line in (dev_data_dir() / "schemas-dev.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["id"] == SLOW_ID:
            return {"json": rec["schema"]}
    raise LookupError(f"{SLOW_ID} is not in the dev data")


@functools.lru_cache(maxsize=1)
def parts():
    """(hf_tokenizer, model), built once per process."""
    import transformers

    transformers.logging.set_verbosity_error()
    return qwen25_hf_tokenizer(), build_tiny_qwen2(vocab_size=VOCAB, seed=0)


def config(**grammar: Any) -> SessionConfig:
    """A session config: compact JSON (no free whitespace), plus ``grammar`` fields."""
    return SessionConfig(
        grammar=GrammarConfig(any_whitespace=False, **grammar),
        distributed=DistributedConfig(step_timeout_s=60.0),
    )


def generate_prepared(
    gen: GenerateSession, ids: Sequence[str | None], *, max_new_tokens: int, synced: bool
) -> tuple[dict, list[list[int]], int]:
    """generate for prepared requests, then finish; returns (results, new-token rows, calls)."""
    hf, model = parts()
    ids = list(ids) or [None]
    enc = encode_prompts(hf, [f"Answer for request {rid}." for rid in ids])
    proc = gen.logits_processor(ids)
    out = model.generate(
        **enc,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        synced_gpus=synced,
        logits_processor=[proc],
        eos_token_id=gen.eos_token_ids,
        pad_token_id=hf.pad_token_id,
    )
    results = gen.finish(proc, out)
    width = enc["input_ids"].shape[1]
    return (
        {k: msgspec.to_builtins(v) for k, v in results.items()},
        out[:, width:].tolist(),
        proc.num_calls,
    )


def run_generate(
    gen: GenerateSession,
    requests: Sequence[tuple[str, dict]],
    *,
    max_new_tokens: int,
    synced: bool,
) -> tuple[dict, list[list[int]], int, dict]:
    """prepare, generate, finish; returns (results, new-token rows, processor calls, outcomes)."""
    outcomes = gen.prepare(requests)
    results, rows, calls = generate_prepared(
        gen, [rid for rid, _ in requests], max_new_tokens=max_new_tokens, synced=synced
    )
    return results, rows, calls, {k: msgspec.to_builtins(v) for k, v in outcomes.items()}


def xgrammar_reference(requests: Sequence[tuple[str, dict]], *, max_new_tokens: int):
    """The same greedy generate with xgrammar's own HF logits processor (no gramcoord)."""
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor

    hf, model = parts()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB)
    compiler = xgr.GrammarCompiler(info)
    grammars = []
    for _, spec in requests:
        if "choice" in spec:
            ebnf = "root ::= " + " | ".join(json.dumps(c) for c in spec["choice"])
            grammars.append(compiler.compile_grammar(ebnf))
        else:
            grammars.append(
                compiler.compile_json_schema(
                    json.dumps(spec["json"]), any_whitespace=False, strict_mode=True
                )
            )
    enc = encode_prompts(hf, [f"Answer for request {rid}." for rid, _ in requests])
    out = model.generate(
        **enc,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        logits_processor=[LogitsProcessor(grammars)],
        eos_token_id=list(info.stop_token_ids),
        pad_token_id=hf.pad_token_id,
    )
    return out[:, enc["input_ids"].shape[1] :].tolist()


# -- rank bodies (run_ranks: the host already called init_process_group) ---------


def dp_body(rank: int, world: int, max_new_tokens: int) -> dict:
    """Partitioned DP: generate under synced_gpus, then xgrammar's processor alone."""
    hf, _ = parts()
    requests = DP_REQUESTS[rank]
    with GenerateSession.create(hf, name=NAME, vocab_size=VOCAB, config=config()) as gen:
        assert gen.world_size == world
        results, rows, calls, outcomes = run_generate(
            gen, requests, max_new_tokens=max_new_tokens, synced=True
        )
        steps = gen.num_steps
    reference = xgrammar_reference(requests, max_new_tokens=max_new_tokens)
    return {
        "results": results,
        "outcomes": outcomes,
        "rows": rows,
        "reference": reference,
        "calls": calls,
        "steps": steps,
        "requests": requests,
    }


def poison_body(rank: int, world: int) -> dict:
    """A bad spec on rank 1 only; then rank 0 submits it and must fail without compiling."""
    hf, _ = parts()
    with GenerateSession.create(hf, name=NAME, vocab_size=VOCAB, config=config()) as gen:
        first = [("r0-ok", SENTIMENT)] if rank == 0 else [("r1-bad", BAD), ("r1-ok", CAPITAL)]
        results, _, _, outcomes1 = run_generate(gen, first, max_new_tokens=4, synced=True)
        stats_before = msgspec.to_builtins(gen.session.stats.manager)
        second = [("r0-bad", BAD)] if rank == 0 else []
        outcomes2 = {k: msgspec.to_builtins(v) for k, v in gen.prepare(second).items()}
        gen.finish()
        stats_after = msgspec.to_builtins(gen.session.stats.manager)
        steps = gen.num_steps
    return {
        "first": outcomes1,
        "results": results,
        "second": outcomes2,
        "stats_before": stats_before,
        "stats_after": stats_after,
        "steps": steps,
    }


def uneven_body(rank: int, world: int, max_new_tokens: int) -> dict:
    """Rank 0 finishes in a few tokens, rank 1 runs to max_new_tokens, under synced_gpus."""
    hf, _ = parts()
    requests = [("r0-capital", CAPITAL)] if rank == 0 else [("r1-confgen", CONFGEN)]
    with GenerateSession.create(hf, name=NAME, vocab_size=VOCAB, config=config()) as gen:
        t0 = time.monotonic()
        results, rows, calls, _ = run_generate(
            gen, requests, max_new_tokens=max_new_tokens, synced=True
        )
        wall = time.monotonic() - t0
    return {"results": results, "rows": rows, "calls": calls, "wall_s": wall}


# -- run_procs body: the session makes the world (async compile with deadlines) -----


def timeout_body(rank: int, world: int, deadlines: dict[int, float], max_new_tokens: int) -> dict:
    """Replicated stream with one slow schema; rank 1's compile deadline is short."""
    hf, _ = parts()
    tok = Tokenizer.from_hf(hf, NAME, vocab_size=VOCAB)
    base = config(compile_timeout_s=deadlines[rank], num_compile_workers=2)
    cfg = msgspec.structs.replace(base, parallel=ParallelConfig(dp=world, requests="replicated"))
    session = RankSession.start(tok, cfg, rank=rank)
    requests = [("quick", SENTIMENT), ("slow", slow_spec())]
    with GenerateSession(session) as gen:
        assert torch.distributed.is_initialized()
        t0 = time.monotonic()
        outcomes = {k: msgspec.to_builtins(v) for k, v in gen.prepare(requests).items()}
        prepare_s = time.monotonic() - t0
        results, _, _ = generate_prepared(
            gen, [rid for rid, _ in requests], max_new_tokens=max_new_tokens, synced=True
        )
    return {"outcomes": outcomes, "results": results, "prepare_s": prepare_s}
