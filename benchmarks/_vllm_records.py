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
# The TP mask digests may cost at most this share of the engine step.
DIGEST_SHARE = 0.02
BACKENDS = ("gramcoord", "xgrammar")


def load_json(path: Path) -> Any:
    return json.loads(path.read_text())


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _share(part: list[float], whole: list[float]) -> str:
    return f"{sum(part) / (sum(whole) or 1.0):.2%} of the step time"


def step_records(xg: dict, gc: dict) -> list[BenchRecord]:
    """Engine step: gramcoord vs xgrammar, constrained vs plain, the hook and the breakdown."""
    size = f"{gc['requests']} requests x {gc['max_tokens']} tokens, {gc['repeat']} rounds"
    same = sum(1 for x, y in zip(gc["outputs"], xg["outputs"]) if x == y)
    runs = {"gramcoord": gc, "xgrammar": xg}
    step = {
        (b, phase): _median(run["samples"][phase].get("step", []))
        for b, run in runs.items()
        for phase in ("constrained", "plain")
    }
    # Each engine interleaves constrained and plain rounds, so the difference
    # cancels most of the load that drifts between the two engines' runs.
    overhead = {b: max(step[b, "constrained"] - step[b, "plain"], 1e-6) for b in BACKENDS}
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
        ),
        BenchRecord.compare(
            "vllm_step_grammar_overhead_gramcoord",
            "vllm_step_grammar_overhead_xgrammar",
            overhead["gramcoord"],
            overhead["xgrammar"],
            note="median constrained step minus median plain step of the same engine "
            f"(rounds interleaved, so load drift between the two engines cancels); {size}",
        ),
    ]
    out += [
        BenchRecord.compare(
            f"vllm_step_constrained_{b}",
            f"vllm_step_plain_{b}",
            step[b, "constrained"],
            step[b, "plain"],
            note=f"the same batch without structured outputs, same engine; {size}",
        )
        for b in BACKENDS
    ]
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
    for phase in ("plain", "constrained"):  # gramcoord's per-step hook against the step
        hook, steps = gc["samples"][phase].get("hook", []), gc["samples"][phase].get("step", [])
        out.append(
            BenchRecord.compare(
                f"vllm_step_hook_{phase}_gramcoord",
                f"vllm_engine_step_{phase}",
                _median(hook),
                _median(steps),
                note=f"gramcoord's per-step hook (before_schedule: the agreement), {phase} "
                f"steps: {_share(hook, steps)}, {len(hook)} calls, max "
                f"{max(hook, default=0.0):.3f} ms; ratio = step / hook; {size}",
            )
        )
    for b, run in runs.items():  # where a constrained step goes
        samples = run["samples"]["constrained"]
        out += [
            BenchRecord.compare(
                f"vllm_step_part_{part}_{b}",
                "vllm_engine_step",
                _median(samples.get(part, [])),
                _median(samples.get("step", [])),
                note=f"{_share(samples.get(part, []), samples.get('step', []))} "
                f"({len(samples.get(part, []))} calls; ratio = step / part); "
                f"vLLM's own function, timed in the engine's process; {size}",
            )
            for part in PARTS
        ]
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


def _measured(ranks: list[dict]) -> list[tuple[dict, ...]]:
    """Per measured round (the warm-up left out), every rank's record of it."""
    return [per for per in zip(*(r["rounds"] for r in ranks)) if not per[0]["warmup"]]


def _slowest(ranks: list[dict], key) -> float:
    """Median over the measured rounds of the slowest rank's ``key(round)``."""
    return _median([max(key(x) for x in per) for per in _measured(ranks)])


def _decode_steps(ranks: list[dict], column: int) -> list[float]:
    """``step_log`` column (1: step ms, 2: hook ms) of the steps in each measured
    round's fast decode window, every rank."""
    return [
        row[column]
        for per in _measured(ranks)
        for rnd in per
        for row in rnd.get("step_log", [])
        if rnd["fast_first_token_ms"] < row[0] <= rnd["fast_done_ms"]
    ]


def kernel_autogroup(path: str = "/proc/sys/kernel/sched_autogroup_enabled") -> str:
    """``"on"``, ``"off"`` or ``"unknown"``: the kernel's session autogroups (CFS group
    scheduling per session), which the free-core figure depends on."""
    try:
        return "on" if Path(path).read_text().strip() == "1" else "off"
    except OSError:
        return "unknown"


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
    agree = all(
        all(x["tokens"] == per[0]["tokens"] for x in per)
        for ranks in (gc, xg)
        for per in zip(*(r["rounds"] for r in ranks))
    )

    def both(key) -> tuple[float, float]:
        return _slowest(gc, key), _slowest(xg, key)

    done = both(lambda x: x["fast_done_ms"])
    slow = both(lambda x: x["slow_done_ms"])
    note = (
        f"torchrun TP=2 external launcher (gloo), {where}: one slow schema sent first, then "
        f"{gc[0]['fast']} fast ones; ms until every fast one finished, slowest rank, median of "
        f"{len(_measured(gc))} rounds (alternated between backends); the slow one finished at "
        f"{slow[0]:.0f} ms (gramcoord) / {slow[1]:.0f} ms (xgrammar); outputs "
        f"{'identical' if agree else 'DIFFERENT'} across ranks"
    )
    if free_core:
        note += (
            f"; kernel autogroup {kernel_autogroup()} (with it on, the two TP ranks that "
            "spin-wait on CPU 0 stall for seconds while a thread of theirs computes on "
            "CPU 1: docs/performance.md)"
        )
    else:
        note += (
            "; here the slow compile shares both cores with the TP pair's lockstepped "
            "decode, which it slows 2-3x (docs/performance.md: why this figure can stay "
            "below the target when the free-core one meets it)"
        )
    same = f"the same rounds ({where}): "
    return [
        BenchRecord.compare(
            f"vllm_tp2_fast_done_gramcoord{tail}",
            f"vllm_tp2_fast_done_xgrammar_sync{tail}",
            *done,
            target=HOL_TARGET,
            note=note,
        ),
        BenchRecord.compare(
            f"vllm_tp2_fast_admitted_gramcoord{tail}",
            f"vllm_tp2_fast_admitted_xgrammar_sync{tail}",
            *both(lambda x: x["fast_first_token_ms"]),
            note=same + "ms until every fast request had its first token (admitted and decoding)",
        ),
        BenchRecord.compare(
            f"vllm_tp2_fast_decode_gramcoord{tail}",
            f"vllm_tp2_fast_decode_xgrammar_sync{tail}",
            *both(lambda x: x["fast_done_ms"] - x["fast_first_token_ms"]),
            note=same + "ms from the last fast first token to the last fast request done "
            "(slowest rank); gramcoord's decode runs while the slow schema still compiles, "
            "vLLM's after its inline compile ended",
        ),
        BenchRecord.compare(
            f"vllm_tp2_fast_decode_step_gramcoord{tail}",
            f"vllm_tp2_fast_decode_step_xgrammar_sync{tail}",
            _median(_decode_steps(gc, 1)),
            _median(_decode_steps(xg, 1)),
            note=same + "median engine step while the fast requests decode (after the last "
            "fast first token, until the last done), every rank; of it in gramcoord's hook (the "
            f"agreement, while the slow one is pending): median "
            f"{_median(_decode_steps(gc, 2)):.2f} ms",
        ),
        *_digest_records(gc, tail, where),
    ]


def _digest_records(gc: list[dict], tail: str, where: str) -> list[BenchRecord]:
    """The TP mask digests' cost per engine step with structured rows, against that step."""
    rows = [
        row
        for per in _measured(gc)
        for rnd in per
        for row in rnd.get("step_log", [])
        if len(row) > 4 and row[4] > 0  # the digests took rows in this step
    ]
    if not rows:
        return []
    digest, step = [row[3] for row in rows], [row[1] for row in rows]
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
            f"{_share(digest, step)} over {len(rows)} steps, every rank, measured rounds; "
            f"ratio = step / digest, target >= {1 / DIGEST_SHARE:.0f} (under "
            f"{DIGEST_SHARE:.0%})",
        )
    ]
