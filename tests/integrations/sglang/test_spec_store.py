"""The spec store under SGLang: a restarted server comes back warm, through SGLang's real manager.

The server's options come from ``GRAMCOORD_SGLANG_OPTIONS`` (SGLang's launch
has no flag for a backend's), read by ``create_backend`` when SGLang's
``GrammarManager`` builds the backend. A stored spec compiles at start, on
the store's thread, exactly as its request compiled (a spec compiles from
its validated text: ``compiled_key``), and the first request for it after
the restart joins that compile: no compile on its path, and the masks are
those of SGLang's own xgrammar backend for the request's key.
"""

from __future__ import annotations

import json
import os
import stat
import threading

import numpy as np
import pytest

pytest.importorskip("sglang")

import torch

from tests import dev_data
from tests.integrations.sglang.host import host, one_rank_manager
from tests.integrations.sglang.ranks import Req, drive

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def compiles(monkeypatch):
    """Every compile our backend runs: (thread name, SGLang key it compiled)."""
    from gramcoord.integrations.sglang.backend import SglangBackend, compiled_key

    seen: list[tuple[str, tuple[str, str]]] = []
    real = SglangBackend._compile

    def compile_(self, spec):
        seen.append((threading.current_thread().name, compiled_key(spec)))
        return real(self, spec)

    monkeypatch.setattr(SglangBackend, "_compile", compile_)
    return seen


def _options(monkeypatch, **store) -> None:
    from gramcoord.integrations.sglang.backend import OPTIONS_ENV

    monkeypatch.setenv(OPTIONS_ENV, json.dumps({"store": store}))


def _same_masks(ours, key, steps: int = 24) -> None:
    """``ours`` fills SGLang's xgrammar backend's masks for ``key``, token after token."""
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    h = host()
    theirs = XGrammarGrammarBackend(
        h.tokenizer, vocab_size=h.vocab_size, model_eos_token_ids=list(h.eos_token_ids)
    )._init_value_dispatch(key, False)
    a = ours.allocate_vocab_mask(h.vocab_size, 1, "cpu")
    b = theirs.allocate_vocab_mask(h.vocab_size, 1, "cpu")
    for _ in range(steps):
        ours.fill_vocab_mask(a, 0)
        theirs.fill_vocab_mask(b, 0)
        assert torch.equal(a, b)
        if theirs.is_terminated():
            return
        bits = np.unpackbits(b[0].numpy().view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: h.vocab_size])
        token = int(allowed[len(allowed) // 2])  # any allowed token, the same for both
        ours.accept_token(token)
        theirs.accept_token(token)


def test_a_restarted_server_serves_a_stored_schema_without_compiling_it(
    tmp_path, monkeypatch, compiles
) -> None:
    store = tmp_path / "store"
    _options(monkeypatch, dir=str(store), ready_wait_s=120)
    # As a request may write it (indented).
    schema = json.dumps(dev_data.schema("Github_easy/o69751"), indent=1)
    first = one_rank_manager()
    try:
        assert drive(first, {0: [Req("s0", schema)]})[-1][1:] == ("s0", "SglangGrammar")
    finally:
        first.grammar_backend.close()
    (record,) = (store / "specs").glob("*.json")
    assert stat.S_IMODE(os.stat(record).st_mode) == 0o600
    ((_, compiled),) = compiles

    compiles.clear()
    second = one_rank_manager()  # ready_wait_s: back once the warm start compiled
    try:
        backend = second.grammar_backend
        assert compiles == [("gramcoord-spec-store", compiled)]
        req = Req("s1", schema)
        assert drive(second, {0: [req]})[-1][1:] == ("s1", "SglangGrammar")
        assert len(compiles) == 1  # nothing compiled on the request's path
        assert backend.grammars.leader._manager.stats.warm == 1
        assert backend.grammars.leader._manager.store.refused == []
        _same_masks(req.grammar, ("json", schema))
    finally:
        second.grammar_backend.close()


def test_an_operators_list_warms_what_sglang_compiles_and_refuses_the_rest(
    tmp_path, monkeypatch, compiles
) -> None:
    schema = dev_data.schema("Github_trivial/o32735")
    listed = tmp_path / "tools.jsonl"
    listed.write_text(
        json.dumps({"json": schema})
        + "\n"
        + json.dumps({"choice": ["yes", "no"]})  # gramcoord's kind, not SGLang's
        + "\n"
        + json.dumps({"regex": "[a-z]{3}-[0-9]{2}"})
        + "\n"
    )
    _options(monkeypatch, preload=[str(listed)], ready_wait_s=120)
    m = one_rank_manager()
    try:
        store = m.grammar_backend.grammars.leader._manager.store
        (why,) = store.refused
        assert "tools.jsonl" in why
        assert (
            "its compile failed: ValueError: SGLang has no grammar kind for a 'choice' spec" in why
        )
        assert [k[0] for _, k in compiles] == ["json", "regex"]  # choice: no key
        # Another text of the same schema: one key, so it joins the warm compile.
        log = drive(m, {0: [Req("w0", json.dumps(schema))]})
        assert log[-1][1:] == ("w0", "SglangGrammar")
        assert len(compiles) == 2
    finally:
        m.grammar_backend.close()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "GRAMCOORD_SGLANG_OPTIONS is not JSON"),
        ("[1, 2]", "must be a JSON object of gramcoord's grammar options, not list"),
        ('{"compile_mode": "sync"}', "compile_mode cannot be set"),
        ('{"stroe": {}}', "Object contains unknown field `stroe`"),
        ('{"store": {"max_records": 0}}', "`$.store.max_records`"),
    ],
)
def test_bad_options_fail_sglangs_start_with_a_message(monkeypatch, value, message) -> None:
    from sglang.srt.constrained.base_grammar_backend import create_grammar_backend

    from gramcoord.integrations.sglang.backend import OPTIONS_ENV

    h = host()
    monkeypatch.setenv(OPTIONS_ENV, value)
    with pytest.raises(ValueError, match="GRAMCOORD_SGLANG_OPTIONS") as info:
        create_grammar_backend(h.server_args, h.tokenizer, h.vocab_size, h.eos_token_ids)
    assert message in str(info.value)


def test_options_reach_the_backend_and_name_their_fields(monkeypatch) -> None:
    from gramcoord.integrations.sglang.backend import OPTIONS_ENV, options_from_env

    assert options_from_env({}).option("compile_timeout_s") == (
        "GRAMCOORD_SGLANG_OPTIONS.compile_timeout_s"
    )
    config = options_from_env({OPTIONS_ENV: '{"poison_ttl_s": 7, "store": {"dir": "/x"}}'})
    assert (config.poison_ttl_s, config.store.dir, config.compile_mode) == (7, "/x", "async")
    assert config.reject_ignored_features is False  # SGLang's check runs at compile
