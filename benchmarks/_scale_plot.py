"""The ``bench scale`` plot: median step time against ranks, one line per path and window.

A hand-written SVG (no plotting dependency): log-log axes, solid lines for
the largest pending count and dashed for the others, one colour per path
(``COLORS``: the three flat paths, then the two two-level ones). The
leading underscore keeps ``gramcoord bench`` from listing this module.
"""

from __future__ import annotations

import math
from pathlib import Path

COLORS = {
    "object": "#d62728",
    "gather": "#1f77b4",
    "reduce": "#2ca02c",
    "host_gather": "#9467bd",
    "host_reduce": "#ff7f0e",
}


def write_svg(series: dict, ranks: list[int], path: Path, title: str, subtitle: str = "") -> None:
    """Write ``series`` {(path name, pending): {ranks: ms}} to ``path`` as an SVG."""
    w, h, m = 640, 420, 60
    vals = [v for pts in series.values() for v in pts.values()]
    lo, hi = math.log10(min(vals)) - 0.1, math.log10(max(vals)) + 0.1
    xs = {r: m + (w - 2 * m) * i / max(1, len(ranks) - 1) for i, r in enumerate(ranks)}

    def y(v):
        return h - m - (h - 2 * m) * (math.log10(v) - lo) / (hi - lo)

    el = [f'<rect width="{w + 60}" height="{h}" fill="white"/>']
    el.append(f'<text x="{w / 2}" y="24" text-anchor="middle">{title}</text>')
    el.append(f'<text x="{w / 2}" y="42" text-anchor="middle" font-size="11">{subtitle}</text>')
    for r, x in xs.items():
        el.append(f'<text x="{x:.0f}" y="{h - m + 20}" text-anchor="middle">{r}</text>')
    el.append(f'<text x="{w / 2}" y="{h - m + 40}" text-anchor="middle">ranks</text>')
    for e in range(math.ceil(lo), math.floor(hi) + 1):
        el.append(
            f'<line x1="{m}" x2="{w - m}" y1="{y(10**e):.1f}" y2="{y(10**e):.1f}" stroke="#ddd"/>'
        )
        el.append(f'<text x="{m - 6}" y="{y(10**e):.1f}" text-anchor="end">{10**e:g}</text>')
    top = max(p for _, p in series)
    for k, ((name, pending), pts) in enumerate(series.items()):
        dash = "" if pending == top else ' stroke-dasharray="6 4"'
        line = " ".join(f"{xs[r]:.1f},{y(v):.1f}" for r, v in sorted(pts.items()))
        el.append(
            f'<polyline points="{line}" fill="none" stroke="{COLORS[name]}" '
            f'stroke-width="2"{dash}/>'
        )
        el.append(
            f'<text x="{w - m + 4}" y="{m + 14 * k}" fill="{COLORS[name]}" '
            f'font-size="11">{name} p{pending}</text>'
        )
    body = "\n".join(el)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w + 60}" height="{h}" '
        f'font-family="sans-serif" font-size="12">\n{body}\n</svg>\n'
    )
