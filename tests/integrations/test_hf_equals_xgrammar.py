"""The ``hf`` path against xgrammar's own HF ``LogitsProcessor``, token for token.

Twelve real schemas from the dev data the repo ships (the first twelve that
our validator admits without a warning or a rewrite and xgrammar compiles), the same
tiny random-weight Qwen2 model, greedy, the same prompts: gramcoord's
``GenerateSession`` and ``xgrammar.contrib.hf.LogitsProcessor`` must emit
the same tokens, row for row.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gramcoord.integrations.hf.generate import GenerateSession
from gramcoord.rank_worker.errors import SpecError
from gramcoord.rank_worker.grammars.schema_rewrite import rewrite
from gramcoord.rank_worker.grammars.schema_tree import canonical_tree
from gramcoord.rank_worker.grammars.spec import validate_spec
from tests.integrations import hf_ranks

DATA = Path(__file__).resolve().parents[1] / "data"
COUNT = 12
MAX_NEW = 24


def dev_requests() -> list[tuple[str, dict]]:
    labels = {}
    for line in (DATA / "schemas-dev.xgrammar-labels.jsonl").read_text().splitlines():
        lab = json.loads(line)
        labels[lab["id"]] = lab["status"]
    config = hf_ranks.config().grammar
    out = []
    for line in (DATA / "schemas-dev.jsonl").read_text().splitlines():
        rec = json.loads(line)
        spec = {"json": rec["schema"]}
        if labels.get(rec["id"]) != "ok":
            continue
        try:
            if validate_spec(spec, config).warnings:
                continue
        except SpecError:
            continue
        tree = canonical_tree(rec["schema"], max_depth=64)
        if rewrite(tree, strict_mode=config.strict_mode, max_depth=64) is not None:
            continue  # we compile an equivalent rewrite, xgrammar the schema as written
        out.append((f"dev{len(out)}", spec))
        if len(out) == COUNT:
            return out
    raise AssertionError(f"fewer than {COUNT} admitted dev schemas")


@pytest.mark.timeout(600)
def test_hf_generate_emits_exactly_what_xgrammars_processor_emits():
    hf, _ = hf_ranks.parts()
    requests = dev_requests()
    config = hf_ranks.config(compile_timeout_s=300.0)
    with GenerateSession.create(
        hf, name=hf_ranks.NAME, vocab_size=hf_ranks.VOCAB, config=config
    ) as gen:
        _, rows, _, outcomes = hf_ranks.run_generate(
            gen, requests, max_new_tokens=MAX_NEW, synced=False
        )
    assert all(o["status"] == "admitted" for o in outcomes.values()), outcomes
    reference = hf_ranks.xgrammar_reference(requests, max_new_tokens=MAX_NEW)
    differing = [
        (rid, mine, theirs)
        for (rid, _), mine, theirs in zip(requests, rows, reference)
        if mine != theirs
    ]
    assert differing == []
