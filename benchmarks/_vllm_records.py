"""The records of ``gramcoord bench vllm``, from its children's JSON (no vLLM import).

Kept apart from the children so the report's shape is tested without an
engine (``tests/benchmarks/test_bench_vllm.py``).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from gramcoord.benchmarks._contract import BenchRecord

# Parts of the engine step reported, in the order of a step.
PARTS = (
    "schedule",
    "forward",
    "grammar_bitmask",
    "sample_tokens",
    "apply_grammar_bitmask",
    "update_from_output",
)
STEP_TARGET = 1.0
HOL_TARGET = 5.0


def load_json(path: Path) -> Any:
    return json.loads(path.read_text())


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _same(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(1 for x, y in zip(a, b) if x == y)


def step_records(xg: dict, gc: dict) -> list[BenchRecord]:
    """Engine step: gramcoord vs xgrammar, constrained vs plain, and the breakdown."""
    size = f"{gc['requests']} requests x {gc['max_tokens']} tokens, {gc['repeat']} rounds"
    same = _same(gc["outputs"], xg["outputs"])
    step = {
        (b, phase): _median(run["samples"][phase].get("step", []))
        for b, run in (("xgrammar", xg), ("gramcoord", gc))
        for phase in ("constrained", "plain")
    }
    out = [
        BenchRecord.compare(
            "vllm_engine_step_gramcoord",
            "vllm_engine_step_xgrammar",
            step["gramcoord", "constrained"],
            step["xgrammar", "constrained"],
            target=STEP_TARGET,
            note=f"median EngineCore.step, in-process CPU engine, {size}; "
            f"token ids identical on {same}/{len(gc['outputs'])} requests"
            + _round_ratios(xg, gc, "constrained"),
        )
    ]
    # Each engine interleaves constrained and plain rounds, so the difference
    # cancels most of the load that drifts between the two engines' runs.
    overhead = {b: step[b, "constrained"] - step[b, "plain"] for b in ("gramcoord", "xgrammar")}
    out.append(
        BenchRecord.compare(
            "vllm_step_grammar_overhead_gramcoord",
            "vllm_step_grammar_overhead_xgrammar",
            max(overhead["gramcoord"], 1e-6),
            max(overhead["xgrammar"], 1e-6),
            note="median constrained step minus median plain step of the same engine "
            f"(rounds interleaved, so load drift between the two engines cancels); {size}",
        )
    )
    for backend in ("gramcoord", "xgrammar"):
        out.append(
            BenchRecord.compare(
                f"vllm_step_constrained_{backend}",
                f"vllm_step_plain_{backend}",
                step[backend, "constrained"],
                step[backend, "plain"],
                note=f"the same batch without structured outputs, same engine; {size}",
            )
        )
    out.append(
        BenchRecord.compare(
            "vllm_step_plain_gramcoord",
            "vllm_step_plain_xgrammar",
            step["gramcoord", "plain"],
            step["xgrammar", "plain"],
            note="median plain step (no structured outputs) of each engine; the code differs "
            f"only by gramcoord's per-step hook; rounds alternated between the engines; {size}"
            + _round_ratios(xg, gc, "plain"),
        )
    )
    out += _hook(gc["samples"], size)
    for backend, run in (("gramcoord", gc), ("xgrammar", xg)):
        out += _breakdown(backend, run["samples"]["constrained"], size)
    return out


def _round_ratios(xg: dict, gc: dict, phase: str) -> str:
    """Each alternated round's ratio (xgrammar's median step / gramcoord's), and their median."""
    ours = gc.get("round_step_ms", {}).get(phase, [])
    theirs = xg.get("round_step_ms", {}).get(phase, [])
    ratios = [t / o for o, t in zip(ours, theirs) if o > 0]
    if not ratios:
        return ""
    listed = ", ".join(f"{r:.2f}" for r in ratios)
    return f"; per alternated round {listed}x, median {_median(ratios):.2f}x"


def _hook(samples: dict[str, dict[str, list[float]]], size: str) -> list[BenchRecord]:
    """gramcoord's per-step hook (``before_schedule``) against the step, per phase."""
    out = []
    for phase in ("plain", "constrained"):
        hook = samples[phase].get("hook", [])
        steps = samples[phase].get("step", [])
        share = sum(hook) / (sum(steps) or 1.0)
        out.append(
            BenchRecord.compare(
                f"vllm_step_hook_{phase}_gramcoord",
                f"vllm_engine_step_{phase}",
                _median(hook),
                _median(steps),
                note=f"gramcoord's per-step hook (before_schedule: the agreement), {phase} "
                f"steps: {share:.2%} of the step time, {len(hook)} calls, max "
                f"{max(hook, default=0.0):.3f} ms; ratio = step / hook; {size}",
            )
        )
    return out


def _breakdown(backend: str, samples: dict[str, list[float]], size: str) -> list[BenchRecord]:
    """Where a constrained step goes: each timed part's median against the step's."""
    step_ms = _median(samples.get("step", []))
    total = sum(samples.get("step", [])) or 1.0
    out = []
    for part in PARTS:
        got = samples.get(part, [])
        share = sum(got) / total
        out.append(
            BenchRecord.compare(
                f"vllm_step_part_{part}_{backend}",
                "vllm_engine_step",
                _median(got),
                step_ms,
                note=f"{share:.0%} of the step time ({len(got)} calls; ratio = step / part); "
                f"vLLM's own function, timed in the engine's process; {size}",
            )
        )
    return out


def _per_round(ranks: list[dict], key: str) -> list[float]:
    """Per measured round: the slowest rank's ``key``."""
    rounds = zip(*(r["rounds"] for r in ranks))
    return [max(x[key] for x in per) for per in rounds if not per[0]["warmup"]]


def _ranks_agree(ranks: list[dict]) -> bool:
    rounds = [r["rounds"] for r in ranks]
    return all(all(x["tokens"] == per[0]["tokens"] for x in per) for per in zip(*rounds))


def hol_records(xg: list[dict], gc: list[dict], *, free_core: bool = False) -> list[BenchRecord]:
    """Time until the fast requests finish: gramcoord async vs vLLM's forced-sync compile.

    ``free_core``: the ``split`` arrangement (decode on CPU 0, compiles on CPU
    1); its records' names end in ``_free_core``.
    """
    tail = "_free_core" if free_core else ""
    where = (
        "every engine on CPU 0, gramcoord's compiles on CPU 1, vLLM's inline compile on both"
        if free_core
        else "2 shared cores"
    )
    ours = _median(_per_round(gc, "fast_done_ms"))
    base = _median(_per_round(xg, "fast_done_ms"))
    slow_gc = _median(_per_round(gc, "slow_done_ms"))
    slow_xg = _median(_per_round(xg, "slow_done_ms"))
    agree = "identical" if _ranks_agree(gc) and _ranks_agree(xg) else "DIFFERENT"
    n = gc[0]["fast"]
    first_gc = _median(_per_round(gc, "fast_first_token_ms"))
    first_xg = _median(_per_round(xg, "fast_first_token_ms"))
    return [
        BenchRecord.compare(
            f"vllm_tp2_fast_done_gramcoord{tail}",
            f"vllm_tp2_fast_done_xgrammar_sync{tail}",
            ours,
            base,
            target=HOL_TARGET,
            note=f"torchrun TP=2 external launcher (gloo), {where}: one slow schema sent first, "
            f"then {n} fast ones; ms until every fast one finished, slowest rank, median of "
            f"{len(_per_round(gc, 'fast_done_ms'))} rounds (alternated between backends); the "
            f"slow one finished at {slow_gc:.0f} ms (gramcoord) / {slow_xg:.0f} ms (xgrammar); "
            f"outputs {agree} across ranks"
            + (
                ""
                if free_core
                else "; here the slow compile shares both cores with the TP pair's lockstepped "
                "decode, which it slows 2-3x (docs/performance.md: why this figure can stay "
                "below the target when the free-core one meets it)"
            ),
        ),
        BenchRecord.compare(
            f"vllm_tp2_fast_admitted_gramcoord{tail}",
            f"vllm_tp2_fast_admitted_xgrammar_sync{tail}",
            first_gc,
            first_xg,
            note=f"the same rounds ({where}): ms until every fast request had its first token "
            "(admitted and decoding)",
        ),
        BenchRecord.compare(
            f"vllm_tp2_fast_decode_gramcoord{tail}",
            f"vllm_tp2_fast_decode_xgrammar_sync{tail}",
            _median(_decode(gc)),
            _median(_decode(xg)),
            note=f"the same rounds ({where}): ms from the last fast first token to the last fast "
            "request done (slowest rank); gramcoord's decode runs while the slow schema still "
            "compiles, vLLM's after its inline compile ended",
        ),
        BenchRecord.compare(
            f"vllm_tp2_fast_decode_step_gramcoord{tail}",
            f"vllm_tp2_fast_decode_step_xgrammar_sync{tail}",
            _median(_decode_steps(gc, 1)),
            _median(_decode_steps(xg, 1)),
            note=f"the same rounds ({where}): median engine step while the fast requests "
            "decode (after the last fast first token, until the last done), every rank; "
            f"of it in gramcoord's hook (the agreement, while the slow one is pending): median "
            f"{_median(_decode_steps(gc, 2)):.2f} ms",
        ),
        *_digest_records(gc, tail, where),
    ]


# The TP mask digests may cost at most this share of the engine step.
DIGEST_SHARE = 0.02


def _digest_records(gc: list[dict], tail: str, where: str) -> list[BenchRecord]:
    """The TP mask digests' cost per engine step with structured rows, against that step."""
    rows = [
        row
        for rank in gc
        for rnd in rank["rounds"]
        if not rnd["warmup"]
        for row in rnd.get("step_log", [])
        if len(row) > 4 and row[4] > 0  # the digests took rows in this step
    ]
    if not rows:
        return []
    digest = [row[3] for row in rows]
    step = [row[1] for row in rows]
    share = sum(digest) / (sum(step) or 1.0)
    return [
        BenchRecord.compare(
            f"vllm_tp2_mask_digest_gramcoord{tail}",
            f"vllm_tp2_engine_step_gramcoord{tail}",
            _median(digest),
            _median(step),
            target=1 / DIGEST_SHARE,
            note=f"the TP mask digests ({where}): ms per engine step with structured rows "
            f"(digest the rows, post and settle the windowed all_gather; steps without rows "
            f"cost a call and are not counted), against that step; "
            f"{share:.2%} of the step time over {len(rows)} steps, every rank, measured rounds; "
            f"ratio = step / digest, target >= {1 / DIGEST_SHARE:.0f} (under "
            f"{DIGEST_SHARE:.0%})",
        )
    ]


def _decode_steps(ranks: list[dict], column: int) -> list[float]:
    """``step_log`` column (1: step ms, 2: hook ms) of the steps in each measured
    round's fast decode window, every rank."""
    out = []
    for rank in ranks:
        for rnd in rank["rounds"]:
            if rnd["warmup"]:
                continue
            lo, hi = rnd["fast_first_token_ms"], rnd["fast_done_ms"]
            out += [row[column] for row in rnd.get("step_log", []) if lo < row[0] <= hi]
    return out


def _decode(ranks: list[dict]) -> list[float]:
    """Per measured round, slowest rank: fast done minus fast first token."""
    rounds = zip(*(r["rounds"] for r in ranks))
    return [
        max(x["fast_done_ms"] - x["fast_first_token_ms"] for x in per)
        for per in rounds
        if not per[0]["warmup"]
    ]
