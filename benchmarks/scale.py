"""How agreement cost grows with the group: object gather vs exchange vs reduce.

``gramcoord bench scale --out DIR`` spawns gloo worlds of each ``--ranks``
size on 127.0.0.1 (one replicated agreement group of every rank) and, for
each ``--pending`` count, measures in one run, interleaved:

- ``sglang_object``: SGLang-style ``all_gather_object`` of the ready/failed
  index sets, then intersection/union (``benchmarks.agreement._sglang_step``);
- ``gather``: ``Agreement(op="all_gather")``: the fixed-shape report exchanged
  with one ``all_to_all_single`` (``Runtime.all_gather``);
- ``reduce``: ``Agreement(op="all_reduce")``: the fixed-size ``all_reduce(BAND)``;

and each against its floor, the bare collective on the same bytes:
``all_to_all_single`` of int64[ranks x gather row], ``all_reduce(BAND)`` of
int64[reduce row], and ``all_gather_object`` of a ``bytes`` object as long
as the pickled sets (so the floor keeps the object path's size exchange and
padded byte gather, and drops only building, pickling and combining sets).

Every rank holds a slightly different window (each clears or fails a few
entries of its own), so the decision is non-trivial; before timing, every
rank checks that the three paths decide the same (the object path has no
reason codes, so only its sets are compared). Every rank times every
contender; records carry the slowest rank's median. Bytes on the wire are
what one rank sends per step: (ranks - 1) x row for the exchange, the ring
estimate 2 (ranks - 1) / ranks x row for the reduce, (ranks - 1) x (8 +
padded pickle) for the object path (its size all_gather, then the bytes).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import pickle
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.agreement import _interleaved, _sglang_step, _status  # noqa: E402
from gramcoord.launch.bench import BenchRecord  # noqa: E402
from gramcoord.launch.procs import free_port, run_procs  # noqa: E402

CHILD_TIMEOUT_S = 300
PATHS = ("object", "gather", "reduce")
COLORS = {"object": "#d62728", "gather": "#1f77b4", "reduce": "#2ca02c"}


# -- child side -----------------------------------------------------------------


def _local_status(pending: int, rank: int, world: int):
    """``_status`` with a few entries of this rank's own still pending or failed."""
    from gramcoord.coordinator.status import LocalStatus, PendingState

    base = _status(pending)
    states, reasons = list(base.states), list(base.reasons)
    for i in range(pending):
        if i % (4 * world) == 4 * rank:  # ready elsewhere, still pending here
            states[i] = PendingState.PENDING
        elif i % (4 * world) == 4 * rank + 1:  # ready elsewhere, failed here
            states[i], reasons[i] = PendingState.FAILED, 30 + rank % 30
    return LocalStatus(seqs=base.seqs, states=tuple(states), reasons=tuple(reasons))


def _rows(rank, world, args, runtime, obj_group):
    import torch
    import torch.distributed as dist

    from gramcoord.coordinator.agreement import Agreement
    from gramcoord.coordinator.report import CODECS
    from gramcoord.coordinator.status import PendingState

    members = runtime.members("agreement")
    pg = runtime.process_group("agreement")
    rows = []
    for pending in args.pending:
        status = _local_status(pending, rank, world)
        agree = {}
        for op in ("all_gather", "all_reduce"):
            agree[op] = Agreement(
                members=members,
                rank=rank,
                window=pending,
                op=op,
                gather=lambda row: runtime.all_gather("agreement", row, operation="g", step=0),
                reduce=lambda row: runtime.all_reduce(
                    "agreement", row, "band", operation="r", step=0
                ),
            )
        counters = {op: iter(range(1, 10**9)) for op in agree}

        def ours(op, agree=agree, counters=counters, status=status):
            return agree[op].decide(next(counters[op]), status, clock_ms=1)

        # The same decision on every path.
        d_gather, d_reduce = ours("all_gather"), ours("all_reduce")
        ready, failed = _sglang_step(status, obj_group, None, None, False, world)
        seqs = status.seqs
        same = (d_gather.ready, d_gather.failed) == (d_reduce.ready, d_reduce.failed)
        same = same and set(d_gather.ready) == {seqs[i] for i in ready}
        same = same and {s for s, _ in d_gather.failed} == {seqs[i] for i in failed}
        assert same, f"rank {rank}: paths disagree at {world} ranks, {pending} pending"

        # Floors: the bare collective on the same bytes.
        g_size, r_size = CODECS["all_gather"](pending).size, CODECS["all_reduce"](pending).size
        a2a_send = torch.zeros(world * g_size, dtype=torch.int64)
        a2a_recv = torch.empty_like(a2a_send)
        red = torch.full((r_size,), -1, dtype=torch.int64)
        mine = (
            {i for i, s in enumerate(status.states) if s == PendingState.READY},
            {i for i, s in enumerate(status.states) if s == PendingState.FAILED},
        )
        pickled = len(pickle.dumps(mine))
        blob = b"x" * pickled
        sizes = [None] * world
        dist.all_gather_object(sizes, pickled, group=obj_group)

        P = functools.partial
        fns = {
            "object": P(_sglang_step, status, obj_group, None, None, False, world),
            "gather": P(ours, "all_gather"),
            "reduce": P(ours, "all_reduce"),
            "object_floor": P(dist.all_gather_object, [None] * world, blob, group=obj_group),
            "gather_floor": P(dist.all_to_all_single, a2a_recv, a2a_send, group=pg),
            "reduce_floor": P(dist.all_reduce, red, op=dist.ReduceOp.BAND, group=pg),
        }
        times = _interleaved(fns, args.repeat)
        # bytes on the wire, sent by one rank per step (see the module docstring)
        padded = max(sizes)
        wire = {
            "object": (world - 1) * (8 + padded),
            "gather": (world - 1) * g_size * 8,
            "reduce": round(2 * (world - 1) / world * r_size * 8),
        }
        rows.append(dict(pending=pending, times=times, wire=wire))
    return rows


def _child(rank: int, world: int, args) -> list[dict]:
    """One rank (``run_procs`` target); every rank returns its own medians."""
    import torch.distributed as dist

    from gramcoord.coordinator.config import DistributedConfig
    from gramcoord.coordinator.layout import ParallelLayout
    from gramcoord.coordinator.runtime import Runtime

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world)})
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    layout = ParallelLayout(dp=world, pp=1, tp=1, requests="replicated")
    cfg = DistributedConfig(step_timeout_s=120)
    with Runtime.attach(layout, distributed=cfg) as runtime:
        obj_group = dist.new_group(
            list(range(world)), backend="gloo", timeout=datetime.timedelta(seconds=120)
        )
        rows = _rows(rank, world, args, runtime, obj_group)
        dist.barrier()
        dist.destroy_process_group(obj_group)
    dist.destroy_process_group()
    return rows


# -- parent side ----------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gramcoord bench scale")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--pending", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--repeat", type=int, default=15, help="~samples per contender")
    ap.add_argument("--plot", type=Path, default=None, help="default: OUT/scale.svg")
    args = ap.parse_args(argv)
    if args.plot is None:  # `gramcoord bench` keeps --out to itself; read it back
        out = argparse.ArgumentParser(add_help=False)
        out.add_argument("--out", default="bench-out")
        args.plot = Path(out.parse_known_args(sys.argv[1:])[0].out) / "scale.svg"
    return args


def _svg(series: dict, ranks: list[int], path: Path) -> None:
    """Median ms against ranks, log-log, one polyline per (path, pending)."""
    import math

    w, h, m = 640, 420, 60
    vals = [v for pts in series.values() for v in pts.values()]
    lo, hi = math.log10(min(vals)) - 0.1, math.log10(max(vals)) + 0.1
    xs = {r: m + (w - 2 * m) * i / max(1, len(ranks) - 1) for i, r in enumerate(ranks)}

    def y(v):
        return h - m - (h - 2 * m) * (math.log10(v) - lo) / (hi - lo)

    el = [f'<rect width="{w}" height="{h}" fill="white"/>']
    el.append(
        f'<text x="{w / 2}" y="24" text-anchor="middle">agreement step, slowest rank '
        "median (ms, log) vs ranks</text>"
    )
    for r, x in xs.items():
        el.append(f'<text x="{x:.0f}" y="{h - m + 20}" text-anchor="middle">{r}</text>')
    for e in range(math.ceil(lo), math.floor(hi) + 1):
        el.append(
            f'<line x1="{m}" x2="{w - m}" y1="{y(10**e):.1f}" y2="{y(10**e):.1f}" stroke="#ddd"/>'
        )
        el.append(f'<text x="{m - 6}" y="{y(10**e):.1f}" text-anchor="end">{10**e:g}</text>')
    for k, ((name, pending), pts) in enumerate(series.items()):
        dash = "" if pending == max(p for _, p in series) else ' stroke-dasharray="6 4"'
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
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w + 40}" height="{h}" '
        f'font-family="sans-serif" font-size="12">\n{body}\n</svg>\n'
    )


def run(args: list[str]) -> list[BenchRecord]:
    """Measure every rank count; see the module docstring."""
    opts = _parse(args)
    records, series, t0 = [], {}, time.monotonic()
    for world in opts.ranks:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        results = run_procs(
            "benchmarks.scale:_child", world, args=(opts,), timeout=CHILD_TIMEOUT_S, env=env
        )
        for i, pending in enumerate(opts.pending):
            per_rank = [r.value[i] for r in results]
            t = {k: max(rows["times"][k] for rows in per_rank) for k in per_rank[0]["times"]}
            wire = per_rank[0]["wire"]
            tag = f"r{world}_p{pending}"
            note = (
                f"{world} gloo ranks on loopback, {os.cpu_count()} cores"
                f"{' (oversubscribed)' if world > (os.cpu_count() or 1) else ''}, "
                f"{pending} pending; slowest rank's median; wire bytes/rank/step: "
            )
            for p in PATHS:
                series.setdefault((p, pending), {})[world] = t[p]
            base = f"sglang_object_{tag}"
            for p in ("gather", "reduce"):
                records.append(
                    BenchRecord.compare(
                        f"scale_{p}_{tag}",
                        base,
                        t[p],
                        t["object"],
                        note=note + f"{wire[p]} ours, {wire['object']} object",
                    )
                )
            for p in PATHS:
                name = f"{'sglang_object' if p == 'object' else 'scale_' + p}_{tag}"
                records.append(
                    BenchRecord.compare(
                        f"{name}_vs_floor",
                        f"floor_{p}_{tag}",
                        t[p],
                        t[p + "_floor"],
                        note=note + f"{wire[p]}; ratio = floor / path (1 = no overhead)",
                    )
                )
    _svg(series, opts.ranks, opts.plot)
    for pending in opts.pending:
        g, r = series[("gather", pending)], series[("reduce", pending)]
        over = [w for w in opts.ranks if r[w] < g[w]]
        cross = next(
            (w for w in opts.ranks if all(r[v] < g[v] for v in opts.ranks if v >= w)), None
        )
        print(
            f"p{pending}: reduce faster than gather at ranks {over}; "
            f"crossover (faster from here on): {cross}"
        )
    print(f"wrote {opts.plot}; benchmark wall time {time.monotonic() - t0:.0f} s")
    return records


if __name__ == "__main__":
    from gramcoord.launch.bench import format_table

    print(format_table(run(sys.argv[1:])))
