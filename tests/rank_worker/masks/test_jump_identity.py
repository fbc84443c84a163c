"""Exact jump-forward gives the same text as no jump-forward.

With a model whose choice depends only on the text so far (and the allowed
set), exact jump-forward must leave outputs unchanged: it jumps only the
part of the forced text that every run without it passes through (see
``gramcoord.rank_worker.masks.jump_forward``). Checked on the issue's
example and on a sample of dev schemas with two text-keyed models:

- ``SyntheticModel`` (follows the reference, else prefers closers);
- ``ReferenceOrBackground`` below: follows the reference, and where the
  reference cannot be continued leaves the choice to a fixed random
  background row, so it often leaves forced text through a token that
  merges forced and free text (``}],`` when only ``}`` is forced) — the case
  that makes greedy jump-forward change outputs.

``measure`` (also ``python -m tests.rank_worker.masks.test_jump_identity``)
reports model steps and the share of identical outputs per mode.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import numpy as np
import pytest
import torch
import xgrammar as xgr

from gramcoord.engine.decoder import GreedyDecoder
from gramcoord.engine.models import ModelRequest, SyntheticModel, vocab_index
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer
from gramcoord.rank_worker.masks.grammar_state import GrammarState
from gramcoord.rank_worker.masks.jump_forward import JumpForward

# Dev schemas in the property test, per any_whitespace value.
_SAMPLE = 30
_MAX_LABEL_COMPILE_MS = 15.0
_MAX_SCHEMA_BYTES = 3000
_MAX_TOKENS = 256


class ReferenceOrBackground:
    """Text-keyed logits: the reference's continuations (longest first) while
    the text is a prefix of it, the stop token at its end; off it, the stop
    token and closers. Everything else keeps a fixed random background
    score, which decides whenever every boosted token is masked."""

    def __init__(self, tokenizer: Tokenizer, *, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        rng = np.random.default_rng(seed)
        self._base = torch.from_numpy(rng.standard_normal(self.vocab_size).astype(np.float32))
        self._index, self._max_len = vocab_index(tokenizer)
        self._closers = [
            self._index[c.encode()] for c in ("}", "]", '"') if c.encode() in self._index
        ]
        self._stops = list(tokenizer.stop_ids)

    def logits(self, rows: Sequence[tuple[ModelRequest, Sequence[int]]]) -> torch.Tensor:
        out = self._base.repeat(len(rows), 1)
        for row, (request, ids) in zip(out, rows):
            text = self.tokenizer.decode_bytes(list(ids))
            ref = (request.reference or "").encode("utf-8")
            if request.reference is not None and ref.startswith(text):
                rest = ref[len(text) :]
                if not rest:
                    row[self._stops] = 100.0
                for n in range(1, min(self._max_len, len(rest)) + 1):
                    token = self._index.get(rest[:n])
                    if token is not None:
                        row[token] = 100.0 + n
            else:
                row[self._closers] = 30.0
                row[self._stops] = 40.0
        return out


def decode(tokenizer, compiled, model, reference: str | None, jump: JumpForward | None, **kw):
    decoder = GreedyDecoder(tokenizer, jump_forward=jump, **kw)
    request = ModelRequest("jump-identity", reference=reference)
    return decoder.decode(GrammarState(compiled), model, request)


# -- the issue's example ----------------------------------------------------

OBJ = {"type": "object", "required": ["foo"]}
PAIR = {"type": "array", "items": False, "prefixItems": [OBJ, OBJ]}
TRIPLE = {"type": "array", "items": False, "prefixItems": [PAIR, PAIR, PAIR]}
TRIPLE_REFERENCE = json.dumps([[{"foo": None}, {"foo": None}]] * 3)


def test_issue_example_exact_keeps_the_merged_token(qwen_tokenizer, compile_json):
    """At ``[[{`` only ``}`` is forced, and the model would pick ``}],``.
    Greedy jump-forward takes that choice away; exact does not jump."""
    tok = qwen_tokenizer
    compiled = compile_json(tok, TRIPLE, any_whitespace=False)
    model = ReferenceOrBackground(tok)
    plain = decode(tok, compiled, model, TRIPLE_REFERENCE, None)
    assert plain.text == "[[{}], [{}]]"
    assert [tok.decode([t]) for t in plain.token_ids[:3]] == ["[[", "{", "}],"]
    for hold_back in (False, True):
        greedy = JumpForward(tok, mode="greedy", hold_back=hold_back)
        assert decode(tok, compiled, model, TRIPLE_REFERENCE, greedy).text == "[[{}]]"
    exact = JumpForward(tok)
    result = decode(tok, compiled, model, TRIPLE_REFERENCE, exact)
    assert result.text == plain.text
    assert result.token_ids == plain.token_ids
    assert exact.stats.num_jumps == 0 and exact.stats.num_forced_bytes_left > 0
    # The same with the synthetic model (which happens to pick "}" here).
    synthetic = SyntheticModel(tok)
    assert (
        decode(tok, compiled, synthetic, TRIPLE_REFERENCE, JumpForward(tok)).text
        == decode(tok, compiled, synthetic, TRIPLE_REFERENCE, None).text
    )


# -- dev schemas ------------------------------------------------------------


def _instance_text(data, any_whitespace: bool) -> str:
    # xgrammar's separators: compact with any_whitespace, ", " / ": " without.
    return json.dumps(data) if not any_whitespace else json.dumps(data, separators=(",", ":"))


def usable_instances(records, tokenizer, any_whitespace: bool, limit: int, compile_json=None):
    """``(id, compiled, valid text, invalid text or None)`` for dev records
    whose first valid instance xgrammar accepts, at most ``limit``."""
    compiler = None if compile_json else xgr.GrammarCompiler(tokenizer.info, max_threads=1)
    out = []
    for rec in records:
        if len(out) >= limit:
            break
        valid = [inst["data"] for inst in rec["instances"] if inst["valid"]]
        invalid = [inst["data"] for inst in rec["instances"] if not inst["valid"]]
        if not valid:
            continue
        text = _instance_text(valid[0], any_whitespace)
        try:
            if compile_json is not None:
                compiled = compile_json(tokenizer, rec["schema"], any_whitespace=any_whitespace)
            else:
                compiled = compiler.compile_json_schema(
                    rec["schema"], any_whitespace=any_whitespace
                )
        except Exception:
            continue
        matcher = xgr.GrammarMatcher(compiled)
        if matcher.accept_string(text) and matcher.is_completed():
            bad = _instance_text(invalid[0], any_whitespace) if invalid else None
            out.append((rec["id"], compiled, text, bad))
    return out


def reference_of(instance: tuple, kind: str) -> str | None:
    """The reference the model follows: the valid instance, the invalid one
    (the model follows it until the grammar forbids it, then improvises), or
    none (it improvises from the start)."""
    _, _, valid, invalid = instance
    return {"valid": valid, "invalid": invalid, "none": None}[kind]


@pytest.fixture(scope="module")
def identity_sample(dev_schemas, qwen_tokenizer, compile_json) -> dict[bool, list[tuple]]:
    records = [
        rec
        for rec in dev_schemas
        if rec["label"].get("status") == "ok"
        and rec["label"].get("compile_ms", 1e9) <= _MAX_LABEL_COMPILE_MS
        and rec["size_bytes"] <= _MAX_SCHEMA_BYTES
    ]
    sample = {
        ws: usable_instances(records, qwen_tokenizer, ws, _SAMPLE, compile_json)
        for ws in (False, True)
    }
    assert all(len(v) >= 20 for v in sample.values()), "too few usable dev schemas"
    return sample


def _model(tokenizer: Tokenizer, kind: str):
    if kind == "synthetic":
        return SyntheticModel(tokenizer)
    if kind == "background":
        return ReferenceOrBackground(tokenizer)
    from gramcoord.engine.models import HFModel, build_tiny_qwen2

    tiny = build_tiny_qwen2(vocab_size=tokenizer.vocab_size)
    return HFModel(tiny, vocab_size=tokenizer.vocab_size)


@pytest.mark.parametrize("any_whitespace", [False, True], ids=["ws0", "ws1"])
@pytest.mark.parametrize("reference", ["valid", "invalid", "none"])
@pytest.mark.parametrize("model_kind", ["synthetic", "background"])
def test_dev_schemas_exact_is_identical(
    qwen_tokenizer, identity_sample, any_whitespace, reference, model_kind
):
    """Same text with exact jump-forward as without, never more steps.

    Runs that end on ``max_tokens`` without jump-forward are not compared
    (the two runs use different token counts); off the reference the
    background model may emit whitespace until then."""
    tok = qwen_tokenizer
    model = _model(tok, model_kind)
    jf = JumpForward(tok)
    steps = {False: 0, True: 0}
    compared = 0
    for instance in identity_sample[any_whitespace]:
        sid, compiled = instance[:2]
        ref = reference_of(instance, reference)
        if reference == "invalid" and ref is None:
            continue
        plain = decode(tok, compiled, model, ref, None, max_tokens=_MAX_TOKENS)
        exact = decode(tok, compiled, model, ref, jf, max_tokens=_MAX_TOKENS)
        if plain.finish_reason == "length":
            continue  # the two runs use different token counts
        assert exact.text == plain.text, sid
        assert exact.finish_reason == plain.finish_reason, sid
        assert exact.num_steps <= plain.num_steps, sid
        steps[False] += plain.num_steps
        steps[True] += exact.num_steps
        compared += 1
    # The background model off its reference often emits optional
    # whitespace until max_tokens (those runs are not comparable).
    assert compared >= (5 if model_kind == "background" and any_whitespace else 15), compared
    assert jf.stats.num_jumps > 0
    assert steps[True] <= steps[False]
    if reference == "valid":
        assert steps[True] < steps[False]


# -- measurement --------------------------------------------------------------


def measure(
    tokenizer: Tokenizer,
    instances: list[tuple],
    model,
    *,
    reference: str = "valid",
    modes: Sequence[str] = ("exact", "greedy"),
    max_tokens: int = 1024,
) -> dict[str, dict]:
    """Decode every instance without jump-forward and in each mode.

    ``instances`` come from ``usable_instances``; ``reference`` picks what
    the model follows (``reference_of``; instances without an invalid one
    are left out for "invalid"). Returns ``{"off": {...}, mode: {...}}``
    with the model steps, the steps saved against "off", how many outputs
    have the same text as "off" (all, and among those "off" did not end on
    ``max_tokens``), how many ended on ``max_tokens``, the seconds taken
    and the jump statistics.
    """
    rows = [(inst[1], reference_of(inst, reference)) for inst in instances]
    if reference == "invalid":
        rows = [(c, r) for c, r in rows if r is not None]
    report: dict[str, dict] = {}
    plain = []
    t0 = time.perf_counter()
    steps = lengths = 0
    for compiled, ref in rows:
        r = decode(tokenizer, compiled, model, ref, None, max_tokens=max_tokens)
        plain.append(r)
        steps += r.num_steps
        lengths += r.finish_reason == "length"
    off = steps
    report["off"] = {"n": len(rows), "steps": steps, "length": lengths}
    report["off"]["s"] = round(time.perf_counter() - t0, 1)
    for mode in modes:
        jf = JumpForward(tokenizer, mode=mode)
        t0 = time.perf_counter()
        steps = lengths = same = same_stopped = 0
        for (compiled, ref), a in zip(rows, plain):
            r = decode(tokenizer, compiled, model, ref, jf, max_tokens=max_tokens)
            steps += r.num_steps
            lengths += r.finish_reason == "length"
            same += r.text == a.text
            same_stopped += r.text == a.text and a.finish_reason != "length"
        report[mode] = {
            "steps": steps,
            "saved_pct": round(100.0 * (off - steps) / off, 1),
            "same": same,
            "same_pct": round(100.0 * same / len(rows), 1),
            # Among the runs that did not end on max_tokens without a jump.
            "same_stopped": f"{same_stopped}/{len(rows) - report['off']['length']}",
            "length": lengths,
            "s": round(time.perf_counter() - t0, 1),
            "stats": jf.stats,
        }
    return report


def _main(argv: list[str] | None = None) -> None:
    from gramcoord.launch.workload import dev_data_dir
    from gramcoord.rank_worker.grammars.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(description=measure.__doc__)
    p.add_argument("--limit", type=int, default=120)
    p.add_argument("--max-label-ms", type=float, default=60.0)
    p.add_argument("--model", choices=["synthetic", "background", "hf"], default="synthetic")
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument(
        "--reference", nargs="+", choices=["valid", "invalid", "none"], default=["valid"]
    )
    args = p.parse_args(argv)
    data = dev_data_dir()
    labels = {}
    for line in (data / "schemas-dev.xgrammar-labels.jsonl").read_text().splitlines():
        rec = json.loads(line)
        labels[rec["id"]] = rec
    records = []
    for line in (data / "schemas-dev.jsonl").read_text().splitlines():
        rec = json.loads(line)
        label = labels.get(rec["id"], {})
        if label.get("status") == "ok" and label.get("compile_ms", 1e9) <= args.max_label_ms:
            records.append(rec)
    tok = load_tokenizer()
    model = _model(tok, args.model)
    for ws in (False, True):
        instances = usable_instances(records, tok, ws, args.limit)
        for reference in args.reference:
            report = measure(tok, instances, model, reference=reference, max_tokens=args.max_tokens)
            print(f"any_whitespace={ws} model={args.model} reference={reference}", flush=True)
            for mode, row in report.items():
                print(f"  {mode}: {row}", flush=True)


if __name__ == "__main__":
    _main()
