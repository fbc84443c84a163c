"""How agreement cost grows with the group: object gather vs exchange vs reduce.

``gramcoord bench scale --out DIR`` spawns gloo worlds of each ``--ranks``
size on 127.0.0.1 (one replicated agreement group of every rank) and, for
each ``--pending`` count, measures in one run, interleaved:

- ``sglang_object``: SGLang-style ``all_gather_object`` of the ready/failed
  index sets, then intersection/union (``benchmarks._agreement_sglang.sglang_step``);
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

``--hosts H`` (root) spreads each world over H simulated hosts
(``gramcoord.benchmarks.simulated_hosts``: network namespaces, veth pairs, a bridge;
``--placement block`` or ``round``; each rank spawned through
``simulated_hosts.on_host``), gloo over the hosts' addresses, and adds
two contenders: the coordinator's own two-level agreement
(``distributed.agreement_levels: host``, ``coordinator.two_level.TwoLevel``) on
each op, ``host_gather`` and ``host_reduce``, each recorded against the flat
path of the same op (ratio = flat / two-level). Before timing, every rank
checks that they return the flat collectives' arrays bit for bit and decide
exactly what the flat paths decide. ``--hosts H --virtual`` groups the ranks
into H hostnames but keeps them on loopback: the same grouping without veth,
the reference that separates the network's share from the CPU's. Worlds with
one rank per host have no two-level run (the coordinator stays flat there).
Busiest-rank bytes for two levels are a leader's: its share of the leaders'
round plus its broadcast to its host.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import math
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from gramcoord.benchmarks._agreement_sglang import local_status, sglang_step
from gramcoord.benchmarks._contract import BenchRecord, interleaved_ms
from gramcoord.launch.ports import free_port
from gramcoord.launch.procs import run_procs

CHILD_TIMEOUT_S = 300
PATHS = ("object", "gather", "reduce")
# Two-level contenders (``coordinator.two_level.TwoLevel``), measured when ranks
# are grouped into hosts; each is compared with the flat path of the same op.
LEVELS = {"host_gather": "gather", "host_reduce": "reduce"}


# -- child side -----------------------------------------------------------------


def _flat_and_levels(rank, pending, runtime, levels):
    """Agreement objects for every contender: flat gather/reduce, and two-level when grouped."""
    from gramcoord.coordinator.agreement import Agreement
    from gramcoord.coordinator.two_level import TwoLevel

    def flat_gather(row):
        return runtime.all_gather("agreement", row, operation="g", step=0)

    def flat_reduce(row):
        return runtime.all_reduce("agreement", row, "band", operation="r", step=0)

    ways = {
        "gather": ("all_gather", flat_gather, None),
        "reduce": ("all_reduce", flat_gather, flat_reduce),
    }
    if levels is not None:  # the coordinator's own two-level calls (agreement_levels: host)
        two = TwoLevel(runtime, levels)

        def two_gather(row):
            return two.all_gather(row, operation="g2", step=0)

        def two_reduce(row):
            return two.all_reduce(row, "band", operation="r2", step=0)

        ways["host_gather"] = ("all_gather", two_gather, None)
        ways["host_reduce"] = ("all_reduce", two_gather, two_reduce)
    members = runtime.members("agreement")
    agree = {
        name: Agreement(members=members, rank=rank, window=pending, op=op, gather=g, reduce=r)
        for name, (op, g, r) in ways.items()
    }
    return agree, ways


def _check_levels(rank, status, pending, members, ways) -> None:
    """The two-level collectives return the flat ones' arrays, bit for bit, on one real row."""
    import numpy as np

    from gramcoord.coordinator.pending_report import CODECS, window_of

    for op, flat, two in (
        ("all_gather", ways["gather"][1], ways["host_gather"][1]),
        ("all_reduce", ways["reduce"][2], ways["host_reduce"][2]),
    ):
        codec = CODECS[op](pending)
        row = np.zeros(codec.size, dtype=np.int64)
        codec.encode(7, window_of(status, pending, codec.max_reason), 1, members.index(rank), row)
        want, got = np.array(flat(row)), np.array(two(row))
        assert np.array_equal(want, got), f"rank {rank}: two-level {op} differs from the flat one"


def _rows(rank, world, args, runtime, obj_group, levels):
    import torch
    import torch.distributed as dist

    from gramcoord.coordinator.pending_report import CODECS
    from gramcoord.coordinator.status import PendingState

    members = runtime.members("agreement")
    pg = runtime.process_group("agreement")
    rows = []
    for pending in args.pending:
        status = local_status(pending, rank, world)
        agree, ways = _flat_and_levels(rank, pending, runtime, levels)
        counters = {name: iter(range(1, 10**9)) for name in agree}

        def ours(name, agree=agree, counters=counters, status=status):
            return agree[name].decide(next(counters[name]), status, clock_ms=1)

        # The same decision on every path; two-level ones equal to the flat ones exactly.
        decided = {name: ours(name) for name in agree}
        d_gather, d_reduce = decided["gather"], decided["reduce"]
        ready, failed = sglang_step(status, obj_group, None, None, False, world)
        seqs = status.seqs
        same = (d_gather.ready, d_gather.failed) == (d_reduce.ready, d_reduce.failed)
        same = same and set(d_gather.ready) == {seqs[i] for i in ready}
        same = same and {s for s, _ in d_gather.failed} == {seqs[i] for i in failed}
        same = same and all(decided[h] == decided[flat] for h, flat in LEVELS.items() if h in agree)
        assert same, f"rank {rank}: paths disagree at {world} ranks, {pending} pending"
        if levels is not None:
            _check_levels(rank, status, pending, members, ways)

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
            "object": P(sglang_step, status, obj_group, None, None, False, world),
            **{name: P(ours, name) for name in agree},
            "object_floor": P(dist.all_gather_object, [None] * world, blob, group=obj_group),
            "gather_floor": P(dist.all_to_all_single, a2a_recv, a2a_send, group=pg),
            "reduce_floor": P(dist.all_reduce, red, op=dist.ReduceOp.BAND, group=pg),
        }
        times = interleaved_ms(fns, args.repeat)
        rows.append(
            dict(pending=pending, times=times, wire=_wire(world, levels, sizes, g_size, r_size))
        )
    return rows


def _wire(world, levels, sizes, g_size, r_size) -> dict[str, int]:
    """Bytes one rank sends per step (the busiest rank for two-level; module docstring)."""
    wire = {
        "object": (world - 1) * (8 + max(sizes)),
        "gather": (world - 1) * g_size * 8,
        "reduce": round(2 * (world - 1) / world * r_size * 8),
    }
    if levels is not None:  # a leader of the largest host: round 2, then its broadcast
        h, k = len(levels.blocks), max(len(b) for b in levels.blocks)
        wire["host_gather"] = ((h - 1) * k + (k - 1) * world) * g_size * 8
        wire["host_reduce"] = round((2 * (h - 1) / h + (k - 1)) * r_size * 8)
    return wire


def _child(rank: int, world: int, args, grouped: bool) -> list[dict]:
    """One rank (``run_procs`` target); every rank returns its own medians."""
    import torch.distributed as dist

    from gramcoord.coordinator.config import DistributedConfig
    from gramcoord.coordinator.layout import ParallelLayout
    from gramcoord.coordinator.runtime import Runtime

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world)})
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    layout = ParallelLayout(dp=world, pp=1, tp=1, requests="replicated")
    # With hosts, the runtime learns every rank's hostname and builds the
    # level groups, exactly as `agreement_levels: host` does in a run.
    cfg = DistributedConfig(step_timeout_s=120, agreement_levels="host" if grouped else "flat")
    with Runtime.attach(layout, distributed=cfg) as runtime:
        obj_group = dist.new_group(
            list(range(world)), backend="gloo", timeout=datetime.timedelta(seconds=120)
        )
        split = layout.host_levels(runtime.hosts) if runtime.hosts else ()
        # None where two levels cannot help (one rank per host): flat only.
        levels = split[0] if split else None
        rows = _rows(rank, world, args, runtime, obj_group, levels)
        dist.barrier()
        dist.destroy_process_group(obj_group)
    dist.destroy_process_group()
    return rows


# -- parent side ----------------------------------------------------------------


def placement(world: int, hosts: int, mode: str) -> tuple[int, ...]:
    """The host index of every rank.

    ``block`` gives host 0 ranks ``0 .. world/H - 1`` and so on (torchrun's
    ``--nproc-per-node`` layout); ``round`` deals ranks out in turn.

    Raises
    ------
    ValueError
        If there are fewer ranks than hosts (a host would be empty).
    """
    if world < hosts:
        raise ValueError(f"{world} ranks cannot fill {hosts} hosts; use at least {hosts} ranks")
    if mode == "round":
        return tuple(r % hosts for r in range(world))
    per, extra = divmod(world, hosts)
    out: list[int] = []
    for h in range(hosts):
        out += [h] * (per + (h < extra))
    return tuple(out)


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Turn SIGTERM into ``SystemExit`` for the block, so ``finally`` and ``with`` exits run.

    The simulated hosts are torn down by context managers and ``atexit``;
    a plain SIGTERM would skip both and leave namespaces behind.
    """

    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    old = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gramcoord bench scale")
    ap.add_argument("--ranks", type=int, nargs="+", default=None, help="default: 2 4 8 16")
    ap.add_argument("--pending", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--repeat", type=int, default=15, help="~samples per contender")
    ap.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="spread each world over this many simulated hosts (root; 1: all on loopback) "
        "and also time the two-level agreement",
    )
    ap.add_argument("--placement", choices=("block", "round"), default="block")
    ap.add_argument(
        "--virtual",
        action="store_true",
        help="with --hosts: group ranks into virtual hosts but keep them on loopback "
        "(the reference for the simulated hosts)",
    )
    ap.add_argument("--plot", type=Path, default=None, help="default: OUT/scale.svg")
    args = ap.parse_args(argv)
    if not 1 <= args.hosts <= 64:
        ap.error(f"--hosts must be 1..64, not {args.hosts}")
    if args.virtual and args.hosts == 1:
        ap.error("--virtual needs --hosts H with H > 1")
    if args.hosts > 1 and os.geteuid() != 0:
        ap.error("--hosts needs root: each rank takes its host's hostname (a UTS namespace)")
    if args.ranks is None:
        args.ranks = [r for r in (2, 4, 8, 16) if r >= args.hosts]
    small = [r for r in args.ranks if r < args.hosts]
    if small or not args.ranks:
        ap.error(f"every world needs at least --hosts {args.hosts} ranks (got {args.ranks})")
    if args.plot is None:  # `gramcoord bench` keeps --out to itself; read it back
        out = argparse.ArgumentParser(add_help=False)
        out.add_argument("--out", default="bench-out")
        args.plot = Path(out.parse_known_args(sys.argv[1:])[0].out) / "scale.svg"
    return args


def _where(opts) -> tuple[str, str]:
    """The record-name suffix and the note's description of where the ranks ran."""
    cores = os.cpu_count() or 1
    if opts.hosts == 1:
        return "", f"gloo ranks on loopback, {cores} cores"
    kind = "virtual hosts on loopback" if opts.virtual else "simulated hosts (netns, veth, bridge)"
    suffix = (
        f"_{'v' if opts.virtual else 'h'}{opts.hosts}{'rr' if opts.placement == 'round' else ''}"
    )
    return suffix, (
        f"gloo ranks over {opts.hosts} {kind}, {opts.placement} placement, {cores} shared cores"
    )


def _spawn(opts, world: int, hosts) -> list:
    """One world's ranks, on loopback or on ``hosts``; returns their results."""
    child = "gramcoord.benchmarks.scale:_child"
    env = {"MASTER_PORT": str(free_port()), "MASTER_ADDR": "127.0.0.1"}
    if opts.hosts == 1:
        return run_procs(child, world, args=(opts, False), timeout=CHILD_TIMEOUT_S, env=env)
    host_of = placement(world, opts.hosts, opts.placement)
    if hosts is None:  # virtual hosts: own hostnames, still loopback
        seats = tuple((None, f"vhost{chr(ord('A') + h)}") for h in host_of)
        env["GLOO_SOCKET_IFNAME"] = "lo"
    else:
        seats = tuple((hosts.namespaces[h], hosts.names[h]) for h in host_of)
        env.update(MASTER_ADDR=hosts.addresses[host_of[0]], GLOO_SOCKET_IFNAME="eth0")
    return run_procs(
        "gramcoord.benchmarks.simulated_hosts:on_host",
        world,
        args=(seats, child, opts, True),
        timeout=CHILD_TIMEOUT_S,
        env=env,
    )


def run(args: list[str]) -> list[BenchRecord]:
    """Measure every rank count; see the module docstring."""
    opts = _parse(args)
    if opts.hosts > 1 and not opts.virtual:
        from gramcoord.benchmarks.simulated_hosts import SimulatedHosts

        with sigterm_unwinds(), SimulatedHosts(opts.hosts) as hosts:
            return _measure(opts, hosts)
    return _measure(opts, None)


def _measure(opts, hosts) -> list[BenchRecord]:
    records, series, t0 = [], {}, time.monotonic()
    suffix, where = _where(opts)
    for world in opts.ranks:
        results = _spawn(opts, world, hosts)
        for i, pending in enumerate(opts.pending):
            per_rank = [r.value[i] for r in results]
            t = {k: max(rows["times"][k] for rows in per_rank) for k in per_rank[0]["times"]}
            wire = per_rank[0]["wire"]
            tag = f"r{world}_p{pending}{suffix}"
            note = (
                f"{world} {where}"
                f"{' (oversubscribed)' if world > (os.cpu_count() or 1) else ''}, "
                f"{pending} pending; slowest rank's median; wire bytes/rank/step: "
            )
            for p in (*PATHS, *(h for h in LEVELS if h in t)):
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
            for h, flat in LEVELS.items():
                if h in t:
                    records.append(
                        BenchRecord.compare(
                            f"scale_{h}_{tag}",
                            f"scale_{flat}_{tag}",
                            t[h],
                            t[flat],
                            note=note + f"{wire[h]} busiest leader, {wire[flat]} flat; "
                            "ratio = flat / two-level (> 1: two-level wins)",
                        )
                    )
    title = "agreement step, slowest rank's median (ms, log) vs ranks"
    write_svg(series, opts.ranks, opts.plot, title, where)
    print(f"wrote {opts.plot}; benchmark wall time {time.monotonic() - t0:.0f} s")
    return records


COLORS = {
    "object": "#d62728",
    "gather": "#1f77b4",
    "reduce": "#2ca02c",
    "host_gather": "#9467bd",
    "host_reduce": "#ff7f0e",
}


def write_svg(series: dict, ranks: list[int], path: Path, title: str, subtitle: str = "") -> None:
    """Write ``series`` {(path name, pending): {ranks: ms}} to ``path`` as an SVG.

    Hand-written (no plotting dependency): log-log axes, solid lines for the
    largest pending count and dashed for the others, one colour per path.
    """
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
