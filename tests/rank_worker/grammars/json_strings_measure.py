"""How three fixes for xgrammar's control-character-blind length rule compare with xgrammar.

xgrammar 0.2.8/0.2.9 build a string bounded by ``minLength``/``maxLength``
from a character class that lets TAB, ``\\x01`` and the other control
characters but CR/LF in raw (``json_strings``). Over the dev schemas this compares, with the real
vocabulary, three ways to keep them out:

- **safe** (what ``json_strings.SafeStrings`` does): xgrammar's own grammar
  for the schema with that rule's class made the one of plain strings;
- **pattern**: the schema rewritten, each bounded string's bounds written as
  an anchored ``pattern`` over the same class (every host compiles the
  rewritten schema);
- **refuse**: schemas with such a string fail at admission.

For each schema with such a string, both fixes are compiled next to the
schema as xgrammar takes it, and compared: every dev instance (valid and
invalid) accepted or refused alike, the token masks along random walks
(identical except for tokens holding a raw control character; the steps
where only those differ show the walks reached a bounded string), and
compile time. Run ``python -m tests.rank_worker.grammars.json_strings_measure``
(about 5 minutes on 2 cores: the pattern fix compiles slowly).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np
import xgrammar as xgr

from gramcoord.rank_worker.config import GrammarConfig, TokenizerConfig
from gramcoord.rank_worker.errors import SpecError
from gramcoord.rank_worker.grammars.json_strings import SafeStrings, safe_grammar_text
from gramcoord.rank_worker.grammars.spec import validate_spec
from gramcoord.rank_worker.grammars.tokenizer import load_tokenizer
from tests import dev_data

_CLASS = '[^\\x00-\\x1f"\\\\]'
_SHAPES = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf", "pattern", "format")


def _as_pattern(node):
    """Every typed string's bounds as an anchored pattern (the rejected fix)."""
    if isinstance(node, list):
        return [_as_pattern(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _as_pattern(v) for k, v in node.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and not any(k in out for k in _SHAPES):
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^{_CLASS}{{{lo},{hi}}}$"
    return out


def _control_tokens(tokenizer) -> np.ndarray:
    """Token ids whose bytes hold a control character (0x00-0x1f)."""
    return np.array(
        [i for i, b in enumerate(tokenizer.token_bytes) if any(c < 0x20 for c in b)], dtype=np.int64
    )


def _mask(matcher, size: int) -> np.ndarray:
    bitmask = xgr.allocate_token_bitmask(1, size)
    matcher.fill_next_token_bitmask(bitmask)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
    return bits[:size].astype(bool)


def _walk_masks(grammars, size, control, rng, steps) -> tuple[int, list[int], list[int]]:
    """Steps taken; per fix (grammars[1:]), the steps where its mask differs from
    xgrammar's (grammars[0]) outside the control tokens, and those where it
    differs on control tokens only (a length-limited string it closed)."""
    matchers = [xgr.GrammarMatcher(g) for g in grammars]
    differ = [0] * (len(grammars) - 1)
    closed = [0] * (len(grammars) - 1)
    for step in range(steps):
        if matchers[0].is_terminated():
            return step, differ, closed
        masks = [_mask(m, size) for m in matchers]
        base = masks[0].copy()
        base[control] = False
        for i, other in enumerate(masks[1:]):
            alt = other.copy()
            alt[control] = False
            differ[i] += not np.array_equal(base, alt)
            closed[i] += np.array_equal(base, alt) and not np.array_equal(masks[0], other)
        both = np.flatnonzero(np.logical_and.reduce(masks))
        if both.size == 0:
            return step + 1, differ, closed
        token = int(rng.choice(both))
        for m in matchers:
            assert m.accept_token(token)
    return steps, differ, closed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--walks", type=int, default=4, help="random walks per schema")
    parser.add_argument("--steps", type=int, default=48, help="tokens per walk")
    parser.add_argument("--limit", type=int, default=0, help="at most this many schemas")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(TokenizerConfig(name="qwen2.5"))
    compiler = xgr.GrammarCompiler(tokenizer.info, max_threads=1, cache_enabled=False)
    size, control = tokenizer.info.vocab_size, _control_tokens(tokenizer)
    rng = random.Random(0)
    safe = SafeStrings(compiler)
    admitted = touched = failed = 0
    rows = []
    for record in dev_data.records():
        try:
            text = validate_spec({"json": record["schema"]}, GrammarConfig()).text
            blind = safe_grammar_text(xgr.Grammar.from_json_schema(text)) is not None
        except (SpecError, RuntimeError):
            failed += 1
            continue
        admitted += 1
        touched += blind
        if not blind or (args.limit and len(rows) >= args.limit):
            continue
        build = {
            "xgrammar": lambda t=text: compiler.compile_json_schema(t),
            "safe": lambda t=text: safe.compile_json_schema(t),
            "pattern": lambda t=text: compiler.compile_json_schema(
                json.dumps(_as_pattern(json.loads(t)))
            ),
        }
        grammars, ms = {}, {}
        for name, make in build.items():
            start = time.perf_counter()
            grammars[name] = make()
            ms[name] = (time.perf_counter() - start) * 1e3
        same = {name: 0 for name in grammars if name != "xgrammar"}
        instances = 0
        for inst in record["instances"]:
            text = json.dumps(inst["data"])
            verdict = {}
            for name, g in grammars.items():
                m = xgr.GrammarMatcher(g)
                verdict[name] = m.accept_string(text) and m.is_completed()
            instances += 1
            for name in same:
                same[name] += verdict[name] == verdict["xgrammar"]
        order = ["xgrammar", *same]
        steps, differ, closed = 0, dict.fromkeys(same, 0), dict.fromkeys(same, 0)
        for _ in range(args.walks):
            taken, bad, shut = _walk_masks(
                [grammars[n] for n in order], size, control, rng, args.steps
            )
            steps += taken
            for name, n, c in zip(order[1:], bad, shut):
                differ[name] += n
                closed[name] += c
        rows.append((record["id"], instances, same, steps, differ, ms, closed))
        timing = {k: round(v, 1) for k, v in ms.items()}
        print(record["id"], instances, same, steps, differ, closed, timing)
    print(
        f"\n{admitted} dev schemas compile ({failed} refused or failing in xgrammar); "
        f"{touched} have a string xgrammar bounds blindly"
    )
    print(f"refuse: {touched} of {admitted} schemas ({100 * touched / admitted:.1f}%) refused")
    for name in ("safe", "pattern"):
        built = [r for r in rows if name in r[2]]
        alike = sum(r[2][name] for r in built)
        differ = sum(r[4][name] for r in built)
        closed = sum(r[6][name] for r in built)
        ratio = [r[5]["xgrammar"] / r[5][name] for r in built]
        print(
            f"{name}: {len(built)}/{len(rows)} schemas compiled; instances alike with xgrammar "
            f"{alike}/{sum(r[1] for r in built)}; mask steps differing outside control tokens "
            f"{differ}/{sum(r[3] for r in built)} (on control tokens only: {closed}); "
            f"compile time xgrammar/{name} median "
            f"{statistics.median(ratio):.2f} (min {min(ratio):.2f})"
        )


if __name__ == "__main__":
    main()
