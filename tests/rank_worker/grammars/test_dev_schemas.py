"""Real schemas, real vocabulary: what the manager admits accepts valid data."""

from __future__ import annotations

import json

import pytest

from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.grammars.manager import GrammarManager

pytestmark = pytest.mark.slow


def _sample(dev_schemas, n: int = 40) -> list[dict]:
    fast = [
        r
        for r in dev_schemas
        if r["label"].get("status") == "ok"
        and r["label"].get("compile_ms", 1e9) < 20
        and any(i["valid"] for i in r["instances"])
        # Only schemas whose valid instances xgrammar itself accepts (it
        # anchors `pattern`, for one): the manager must not lose any.
        and r["label"].get("valid_accepted") == r["label"].get("valid_total")
    ]
    step = max(1, len(fast) // n)
    return fast[::step][:n]


def test_admitted_schemas_accept_their_valid_instances(qwen_tokenizer, dev_schemas):
    sample = _sample(dev_schemas)
    assert len(sample) >= 30
    # JSON Schema allows unknown properties unless told otherwise; xgrammar's
    # strict_mode forbids them, so valid instances need strict_mode off.
    # The compile deadline's clock stands still: every schema here is known
    # to compile, and on a busy machine (compile threads are niced) one may
    # take longer than grammar.compile_timeout_s; what is tested is what an
    # admitted grammar accepts, whatever the timing.
    manager = GrammarManager(GrammarConfig(strict_mode=False), qwen_tokenizer, clock=lambda: 0.0)
    try:
        by_id = {}
        for rec in sample:
            out = manager.add(rec["id"], {"json": rec["schema"]})
            by_id[rec["id"]] = rec
            assert out.status in ("pending", "failed")
        admitted = []
        while manager.num_pending:
            manager.wait_pending(0.05)  # sleep on the compile pool, never spin
            for o in manager.step():
                if o.status == "admitted":
                    admitted.append(o.request_id)
                else:
                    assert o.code in ("grammar_invalid",), o
    finally:
        manager.close()
    assert len(admitted) >= 20
    checked = 0
    for rid in admitted:
        for inst in by_id[rid]["instances"]:
            if not inst["valid"]:
                continue
            # The instance as a value: spaced, or compact where the grammar
            # holds it as a literal (xgrammar matches an object or array in a
            # `const` / `enum` only as its compact text, whatever
            # any_whitespace says; a rewrite may enforce such a literal where
            # xgrammar, given the schema as written, enforced nothing).
            texts = [
                json.dumps(inst["data"], ensure_ascii=False),
                json.dumps(inst["data"], ensure_ascii=False, separators=(",", ":")),
            ]
            accepted = []
            for text in texts:
                matcher = manager.matcher(rid)
                accepted.append(matcher.accept_string(text) and matcher.is_completed())
            assert any(accepted), (rid, texts[0][:200])
            checked += 1
    assert checked >= 20
