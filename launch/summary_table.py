"""The readable table ``gramcoord run`` prints at the end."""

from __future__ import annotations

import time
from pathlib import Path

from rich.table import Table

from gramcoord.launch.summary import Determinism, Summary

# When the ``gramcoord`` command started (``time.monotonic()``); set by the
# CLI, so the headline's time includes start-up (launching the ranks,
# imports, rendezvous), not only rank 0's own run.
_command_started: float | None = None


def command_started() -> None:
    """Mark now as the start of the command whose run the table reports."""
    global _command_started
    _command_started = time.monotonic()


def headline(s: Summary, out_dir: Path | None = None) -> str:
    """``N requests in Xs`` with start-up included when known, and the parts."""
    where = f" -> {out_dir}" if out_dir is not None else ""
    parts = f"rank 0 {s.wall_s:.1f}s, step loop {s.loop_s:.1f}s"
    if _command_started is not None:
        total = time.monotonic() - _command_started
        took = f"{total:.1f}s wall, start-up included ({parts})"
    else:
        took = f"{s.wall_s:.1f}s on rank 0 (step loop {s.loop_s:.1f}s)"
    return f"gramcoord run: {s.requests['total']} requests in {took}{where}"


def determinism_line(d: Determinism) -> str:
    """The verdict, honest when nothing was compared."""
    counts = f"{d.ranks_compared} ranks, {d.steps_compared} steps, {d.rows_compared} rows compared"
    if d.mismatches:
        return f"{d.mismatches} MISMATCHES: {counts}"
    if not (d.rows_compared or d.steps_compared):
        return f"nothing compared: no mask row was applied on two ranks ({counts})"
    return f"identical: {counts}"


def summary_table(s: Summary, out_dir: Path | None = None) -> Table:
    t = Table(title=headline(s, out_dir))
    t.add_column("what")
    t.add_column("value", justify="right")
    r = s.requests
    t.add_row("requests ok / failed", f"{r['ok']} / {r['failed']}")
    for code, n in sorted(r["by_error"].items(), key=lambda kv: -kv[1]):
        t.add_row(f"  {code}", str(n))
    t.add_row("finish reasons", ", ".join(f"{k} {v}" for k, v in sorted(s.finish_reasons.items())))
    tk = s.tokens
    t.add_row("tokens generated", str(tk["generated"]))
    t.add_row("model steps (per request)", str(tk["model_steps"]))
    t.add_row("jump-forward tokens", str(tk["jump_forward_tokens"]))
    t.add_row("loop steps", str(s.steps))
    c = s.cache
    t.add_row(
        "cache hits / misses / joined / poisoned",
        f"{c['hits']} / {c['misses']} / {c['joined']} / {c['poisoned_hits']}",
    )
    j = s.json_valid
    t.add_row(
        "JSON outputs valid / parsed / checked",
        f"{j['valid']} / {j['parsed']} / {j['checked']}",
    )
    e = s.end_checks
    if e.get("checked"):
        t.add_row("end-checked outputs failed / checked", f"{e['failed']} / {e['checked']}")
    jc = s.json_checks
    if jc.get("checked"):
        t.add_row("JSON-checked outputs not JSON / checked", f"{jc['failed']} / {jc['checked']}")
    for name, p in s.latency_ms.items():
        t.add_row(f"{name} ms p50 / p99", f"{p.p50:.3f} / {p.p99:.3f} (n={p.count})")
    t.add_row("determinism", determinism_line(s.determinism))
    return t
