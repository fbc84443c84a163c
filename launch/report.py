"""The readable table ``gramcoord run`` prints at the end."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from gramcoord.launch.summary import Summary


def summary_table(s: Summary, out_dir: Path | None = None) -> Table:
    where = f" -> {out_dir}" if out_dir is not None else ""
    t = Table(title=f"gramcoord run: {s.requests['total']} requests in {s.wall_s:.1f}s{where}")
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
    for name, p in s.latency_ms.items():
        t.add_row(f"{name} ms p50 / p99", f"{p.p50:.3f} / {p.p99:.3f} (n={p.count})")
    d = s.determinism
    verdict = "identical" if d.mismatches == 0 else f"{d.mismatches} MISMATCHES"
    t.add_row(
        "determinism",
        f"{verdict}: {d.ranks_compared} ranks, {d.steps_compared} steps, "
        f"{d.rows_compared} rows compared",
    )
    return t
