"""Session fixtures shared by every test package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gramcoord.rank_worker.config import TokenizerConfig
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer, load_tokenizer

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def make_tiny_tokenizer() -> Tokenizer:
    """256 single bytes, a few multi-byte pieces, one stop and one special."""
    pieces = [bytes([i]) for i in range(256)] + [b'{"', b'":', b'"}', b"true", b"  "]
    token_bytes = [*pieces, b"</s>", b"<tool>"]
    stop = len(pieces)
    return Tokenizer(
        name="tiny",
        token_bytes=token_bytes,
        special_ids={"</s>": stop, "<tool>": stop + 1},
        stop_ids=(stop,),
        encoder=lambda text: list(text.encode("utf-8")),
    )


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Tokenizer:
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def qwen_tokenizer() -> Tokenizer:
    return load_tokenizer(TokenizerConfig(name="qwen2.5"))


@pytest.fixture(scope="session")
def dev_schemas() -> list[dict]:
    path = DATA / "schemas-dev.jsonl"
    if not path.is_file():
        pytest.skip(f"dev data not found at {path}")
    labels = {}
    label_path = DATA / "schemas-dev.xgrammar-labels.jsonl"
    if label_path.is_file():
        for line in label_path.read_text().splitlines():
            rec = json.loads(line)
            labels[rec["id"]] = rec
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        rec["label"] = labels.get(rec["id"], {})
        out.append(rec)
    return out
