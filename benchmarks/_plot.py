"""``bench.png`` of ``gramcoord bench all``: targets met, and where a step's time goes.

Left: every record that has a target, as its ratio divided by the target on
a log axis (a time target ``target_ms`` counts as ``target_ms / ours``), so
1 is the line to reach: green met, red missed; a failed benchmark is a grey
row. Right: the default config's per-step latency breakdown (p50 bars, p99
in the label) from its run's ``summary.json``.

Drawn with matplotlib's Agg canvas directly (no pyplot): no display, no
global figure state.
"""

from __future__ import annotations

import re
from pathlib import Path

from gramcoord.benchmarks._contract import BenchRecord
from gramcoord.benchmarks._tables import StepBreakdown, target_text

MET, MISSED, FAILED = "#2ca02c", "#d62728", "#7f7f7f"
# Scores are clipped to this range so one wild ratio cannot squash the axis.
LO, HI = 1e-3, 1e3


def score(r: BenchRecord) -> float | None:
    """How far a record is from its target: >= 1 met; None without a target."""
    parts = []
    if r.target is not None and r.target > 0:
        parts.append(r.ratio / r.target)
    if r.target_ms is not None and r.median_ms > 0:
        parts.append(r.target_ms / r.median_ms)
    return min(parts) if parts else None


def _label(r: BenchRecord, records: list[BenchRecord]) -> str:
    """``bench: name``, told apart when the name repeats: by the baseline when
    that differs, else by the note's first clause (where sizes go)."""
    label = f"{r.bench}: {r.name}"
    same = [o for o in records if (o.bench, o.name) == (r.bench, r.name)]
    if len(same) == 1:
        return label
    if sum(1 for o in same if o.baseline == r.baseline) == 1:
        return f"{label} vs {r.baseline}"
    return f"{label} ({re.split(r'[;(]', r.note)[0].strip()[:40]})"


def _targets(ax, records: list[BenchRecord]) -> None:
    scored = [(r, s) for r in records if r.error is None and (s := score(r)) is not None]
    failed = [r for r in records if r.error is not None]
    if not scored and not failed:
        ax.text(0.5, 0.5, "no record with a target", ha="center", va="center")
        ax.set_axis_off()
        return
    labels = []
    for y, (r, s) in enumerate(scored):
        v = min(max(s, LO), HI)
        color = MET if r.met else MISSED
        ax.hlines(y, 1.0, v, color=color, lw=2)
        ax.scatter([v], [y], color=color, zorder=3, s=18)
        text = f"{r.ratio:.2f}x" if r.target_ms is None else f"{r.median_ms:.3g} ms"
        ax.annotate(
            f"{text} ({target_text(r)})",
            (v, y),
            xytext=(5 if v >= 1 else -5, 0),
            textcoords="offset points",
            fontsize=6,
            va="center",
            ha="left" if v >= 1 else "right",
        )
        labels.append(_label(r, records))
    for i, r in enumerate(failed, start=len(scored)):
        ax.scatter([1.0], [i], marker="x", color=FAILED, zorder=3)
        ax.annotate(
            f"failed: {(r.error or '')[:70]}",
            (1.0, i),
            xytext=(5, 0),
            textcoords="offset points",
            fontsize=6,
            va="center",
            color=FAILED,
        )
        labels.append(f"{r.bench}: ERROR")
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xscale("log")
    # Room for the labels on both sides of the line at 1.
    values = [min(max(s, LO), HI) for _, s in scored] + [1.0]
    ax.set_xlim(min(values) / 8, max(values) * 8)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_xlabel("ratio / target (log; >= 1: met)")
    met = sum(1 for r, _ in scored if r.met)
    ax.set_title(f"Records with a target: {met} of {len(scored)} met, {len(failed)} failed")
    ax.grid(axis="x", which="major", color="#dddddd")


def _breakdown(ax, b: StepBreakdown | None) -> None:
    if b is None or b.error:
        why = "not run (--no-run)" if b is None else f"run failed: {b.error[:80]}"
        ax.text(0.5, 0.5, why, ha="center", va="center", wrap=True)
        ax.set_axis_off()
        return
    names = [p.name for p in b.phases] + b.missing
    p50 = [p.p50_ms for p in b.phases]
    ax.barh(range(len(p50)), p50, color="#1f77b4")
    for y, p in enumerate(b.phases):
        ax.annotate(
            f" p50 {p.p50_ms:.3g}, p99 {p.p99_ms:.3g} (n={p.count})",
            (p.p50_ms, y),
            fontsize=7,
            va="center",
        )
    for y in range(len(p50), len(names)):
        ax.annotate("not in summary.json", (0, y), fontsize=7, va="center", color=FAILED)
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlim(0, max(p50, default=1.0) * 1.9)
    ax.set_xlabel("ms per step and rank (p50)")
    ax.set_title(f"Per-step latency, {b.config} ({b.steps} steps)")


def plot(records: list[BenchRecord], breakdown: StepBreakdown | None, path: Path) -> Path:
    """Write ``bench.png`` to ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = sum(1 for r in records if r.error is not None or score(r) is not None)
    fig = Figure(figsize=(16, max(4.5, 0.24 * rows + 1.5)), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, width_ratios=[3, 2])
    _targets(left, records)
    _breakdown(right, breakdown)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
