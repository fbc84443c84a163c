"""Session fixtures shared by every test package."""

from __future__ import annotations

import json
import secrets
import signal
import time
from pathlib import Path

import pytest

from gramcoord.launch.workload import dev_data_dir
from gramcoord.rank_worker.config import TokenizerConfig
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer, load_tokenizer
from gramcoord.sync.janitor import remove
from tests import dev_data
from tests.sync.transport_peers import ipc_dirs, shm_names

# A suite started in the background (`cmd &`, nohup) inherits SIGINT ignored,
# and Python then never raises KeyboardInterrupt. The Ctrl-C tests send real
# SIGINTs to this process and to the runs it starts (which inherit the
# disposition): give both Python's own handler, as a terminal would.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# $GRAMCOORD_DATA_DIR, else the full set in ../shared/data when it is there,
# else the repo's own subset in tests/data (tests/data/README.md).
DATA: Path = dev_data_dir()


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
    """Dev schema records, each with its xgrammar label under ``"label"``."""
    labels = {}
    for line in (DATA / "schemas-dev.xgrammar-labels.jsonl").read_text().splitlines():
        rec = json.loads(line)
        labels[rec["id"]] = rec
    out = dev_data.records()
    for rec in out:
        rec["label"] = labels.get(rec["id"], {})
    return out


@pytest.fixture
def run_id() -> str:
    """A run id unique to this test; every segment the test makes carries it.

    After the test, anything of this run left in /dev/shm or the temp dir is
    removed and reported as a leak.
    """
    rid = f"t{secrets.token_hex(5)}"
    yield rid
    # A killed child's reaper removes its names a moment after the kill.
    deadline = time.monotonic() + 5
    while (shm_names(rid) or ipc_dirs(rid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    leaked = [("shm", n) for n in shm_names(rid)] + [("dir", d) for d in ipc_dirs(rid)]
    for kind, name in leaked:
        remove(kind, name)
    assert not leaked, f"transport leaked {leaked}"
