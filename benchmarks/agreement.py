"""Agreement cost against SGLang's way, as the group grows; PP hop and pp_sync, over gloo.

``gramcoord bench agreement`` (or ``run_bench('agreement', [], out)``)
starts its own ranks: for each ``--worlds`` size it spawns that many ranks
through ``gramcoord.launch.procs``, which build gloo worlds on 127.0.0.1
with a free port and measure, side by side in one run, for each
``--pending`` count:

- ``agreement``: one coordinator step of a replicated group (encode, one
  collective, combine, decide, apply) against SGLang's way (``sglang_step``
  below): pickled ``all_gather_object`` of the ready/failed index sets,
  then set intersection/union. With ``pp=2`` both also carry the decision
  to stage 1 (ours: one tensor send; SGLang: ``send_object_list``).
  Target >= 3x.
- ``agreement_reduce``: the same step with the fixed-size
  ``all_reduce(BAND)`` report (reported only).
- ``..._vs_floor_dp{N}`` (pp=1): each of the three against the bare collective on
  the same bytes: ``all_to_all_single`` of int64[ranks x gather row] (what
  ``Runtime.all_gather`` posts), ``all_reduce(BAND)`` of int64[reduce row],
  and ``all_gather_object`` of a ``bytes`` object as long as the pickled
  sets (the object path's size exchange and padded byte gather, without
  building, pickling and combining sets). Ratio = floor / path; reported
  only. The notes give the bytes one rank sends per step: (ranks - 1) x row
  for the exchange, the ring estimate 2 (ranks - 1) / ranks x row for the
  reduce, (ranks - 1) x (8 + pickle) for the object path.
- ``pp_hop`` (2 ranks): round trip of one decision hop plus a 1-element
  ack, against a 1-element gloo ping plus the same ack. Ratio convention:
  ping / hop, so "hop within 1.5x of a ping" is ratio >= 1/1.5 = 0.667.
- ``pp_sync_chain`` (2 and 4 ranks): a pipeline step with the decision
  sent down the chain, against ``pp_sync: collective`` (every stage leader
  in one all_gather); both end with the last stage's 1-element ack to
  stage 0. Reported only.

Worlds of 2 ranks run dp=2 and the hop; of 4, dp=4 and dp=2 x pp=2; larger
worlds (docs/scaling.md: how the cost grows) only the replicated group.

Each pending request's local state is fixed (``StaticMember``): half ready,
a quarter pending, a quarter failed, and on each DP member a few requests
that others see ready are still pending or failed there, so the
intersection and union matter. Every step decides the same non-trivial
outcome.

How it is measured, the same way for ours and the baseline:

- every rank times every contender (``interleaved_ms``: alternating rounds of
  short medians); each figure is the slowest rank's median. The floors run
  after every targeted row, in rounds of their own with the three paths
  timed again beside them, so the targeted rows are timed as if no floor
  existed;
- the timed call ends when this rank is done with the step: our chain's
  asynchronous send is drained inside it (``Runtime.drain``), as the
  baseline's blocking ``send_object_list`` is;
- before and after timing, each rank checks that ours and the baseline
  reached the same decision (the same ready and failed sequence numbers),
  and that the chain and the collective ``pp_sync`` did; a mismatch stops
  the bench.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import os
import pickle

from gramcoord.benchmarks._contract import BenchRecord, interleaved_ms
from gramcoord.launch.ports import free_port
from gramcoord.launch.procs import run_procs

CHILD_TIMEOUT_S = 600
# The paths of the replicated group's step timed against their floor (pp=1):
# contender -> (its record's name, the floor's).
FLOORS = {
    "all_gather": ("agreement_gather", "floor_all_to_all_single"),
    "all_reduce": ("agreement_reduce", "floor_all_reduce_band"),
    "base": ("sglang_object", "floor_all_gather_object_bytes"),
}


# -- the pending windows, and SGLang's way of agreeing on them ---------------------


class StaticMember:
    """A member whose pending window never changes: steady-state steps."""

    def __init__(self, status) -> None:
        self.status = status

    def local_status(self):
        return self.status

    def apply_decision(self, decision):
        return decision

    def new_failures(self):
        return []

    def apply_poison(self, records):
        return None


def shared_status(pending: int):
    from gramcoord.coordinator.status import LocalStatus, PendingState

    states = [
        (PendingState.READY, PendingState.READY, PendingState.PENDING, PendingState.FAILED)[i % 4]
        for i in range(pending)
    ]
    reasons = [21 if s == PendingState.FAILED else 0 for s in states]
    return LocalStatus(
        seqs=tuple(range(1000, 1000 + pending)), states=tuple(states), reasons=tuple(reasons)
    )


def local_status(pending: int, member: int, members: int):
    """``shared_status`` with a few requests of this DP member still pending or failed."""
    from gramcoord.coordinator.status import LocalStatus, PendingState

    base = shared_status(pending)
    states, reasons = list(base.states), list(base.reasons)
    for i in range(pending):
        if i % (4 * members) == 4 * member:  # ready elsewhere, still pending here
            states[i] = PendingState.PENDING
        elif i % (4 * members) == 4 * member + 1:  # ready elsewhere, failed here
            states[i], reasons[i] = PendingState.FAILED, 30 + member % 30
    return LocalStatus(seqs=base.seqs, states=tuple(states), reasons=tuple(reasons))


def sglang_step(status, group, chain_group, chain_peer, is_sender, world):
    """SGLang-style: pickled index sets gathered, then pickled objects down the chain.

    Returns the decided ``(ready, failed)`` index sets; a later stage returns
    the ones it received.
    """
    import torch.distributed as dist

    from gramcoord.coordinator.status import PendingState

    if chain_group is not None and not is_sender:
        got = [None]
        dist.recv_object_list(got, src=chain_peer, group=chain_group)
        ready, failed = got[0]
        return set(ready), set(failed)
    ready = {i for i, s in enumerate(status.states) if s == PendingState.READY}
    failed = {i for i, s in enumerate(status.states) if s == PendingState.FAILED}
    if group is not None:
        out = [None] * world
        dist.all_gather_object(out, (ready, failed), group=group)
        ready = set.intersection(*(r for r, _ in out))
        failed = set.union(*(f for _, f in out))
        ready -= failed
    if chain_group is not None:
        dist.send_object_list([(sorted(ready), sorted(failed))], dst=chain_peer, group=chain_group)
    return ready, failed


# -- every rank (``child``) ------------------------------------------------------


def _steps(coord, member, runtime):
    """One coordinator step per call, its asynchronous chain send drained."""
    counter = itertools.count(1)

    def one():
        result = coord.step(next(counter), member)
        runtime.drain()
        return result

    return one


def _decided(result) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Ready and failed sequence numbers of one of our steps (a ``StepResult``)."""
    decision = result.decision
    return tuple(sorted(decision.ready)), tuple(sorted(s for s, _ in decision.failed))


def _measure(rank: int, where: str, fns: dict, decisions, repeat: int) -> dict[str, float]:
    """``interleaved_ms(fns)``; before and after it, ``decisions()`` (one call of
    every contender) must give every contender the same decision on this rank."""

    def check(when: str) -> None:
        got = decisions()
        if len(set(got.values())) != 1:
            sizes = {k: (len(r), len(f)) for k, (r, f) in got.items()}
            raise RuntimeError(
                f"rank {rank}, {where}, {when} timing: contenders decided differently "
                f"((ready, failed) counts {sizes})"
            )

    check("before")
    times = interleaved_ms(fns, repeat)
    check("after")
    return times


def _layout_rows(rank, args, dp, pp):
    """Our step (gather, and reduce when pp=1) vs the SGLang-style step, dp x pp replicated;
    with pp=1 each of the three also against its floor (``_floors``)."""
    import torch.distributed as dist

    from gramcoord.coordinator.config import DistributedConfig
    from gramcoord.coordinator.coordinator import Coordinator
    from gramcoord.coordinator.layout import ParallelLayout
    from gramcoord.coordinator.runtime import Runtime

    layout = ParallelLayout(dp=dp, pp=pp, tp=1, requests="replicated")
    timeout = datetime.timedelta(seconds=60)
    name = f"agreement_dp{dp}_pp{pp}"
    rows = []
    with Runtime.attach(layout, distributed=DistributedConfig(step_timeout_s=60)) as runtime:
        # Baseline groups: the same members, their own gloo groups.
        leaders = list(layout.dp_leaders())
        base_group = dist.new_group(leaders, backend="gloo", timeout=timeout)
        chains = [
            dist.new_group(list(c), backend="gloo", timeout=timeout) for c in layout.pp_chains()
        ]
        c = layout.coords(rank)
        peer = layout.chain_next(rank) if c.pp == 0 else layout.chain_prev(rank)
        base = functools.partial(
            sglang_step,
            group=base_group if rank in leaders and dp > 1 else None,
            chain_group=chains[c.dp] if pp > 1 else None,
            chain_peer=peer,
            is_sender=c.pp == 0,
            world=dp,
        )
        later = []  # (pending, the paths and their floors, bytes per step)
        for pending in args.pending:
            status = local_status(pending, c.dp, dp)
            member = StaticMember(status)
            fns = {
                op: _steps(
                    Coordinator(layout, runtime, window=pending, agreement_op=op, clock=lambda: 1),
                    member,
                    runtime,
                )
                for op in (("all_gather", "all_reduce") if pp == 1 else ("all_gather",))
            }
            fns["base"] = functools.partial(base, status)

            def decisions(fns=fns, seqs=status.seqs):
                got = {op: _decided(fn()) for op, fn in fns.items() if op != "base"}
                ready, failed = fns["base"]()
                got["base"] = (
                    tuple(sorted(seqs[i] for i in ready)),
                    tuple(sorted(seqs[i] for i in failed)),
                )
                return got

            floors, wire = (
                _floors(status, dp, pending, runtime, base_group) if pp == 1 else ({}, {})
            )
            where = f"{name}, {pending} pending"
            # The targeted rows: ours against SGLang's way, in rounds of their own.
            times = _measure(rank, where, fns, decisions, args.repeat)
            rows.append(
                dict(name=name, ours=times["all_gather"], base=times["base"], pending=pending)
            )
            if pp > 1:
                continue
            rows.append(
                dict(
                    name=f"agreement_reduce_dp{dp}_pp{pp}",
                    ours=times["all_reduce"],
                    base=times["base"],
                    gather=times["all_gather"],
                    pending=pending,
                )
            )
            later.append((pending, {**fns, **floors}, wire))
        # Each path against its floor, after every targeted row: the paths
        # timed again, in the floors' rounds.
        for pending, fns, wire in later:
            with_floors = interleaved_ms(fns, args.repeat)
            for path, (label, _) in FLOORS.items():
                rows.append(
                    dict(
                        name=f"{label}_vs_floor_dp{dp}",
                        path=path,
                        ours=with_floors[path],
                        base=with_floors[f"{path}_floor"],
                        bytes=wire[path],
                        pending=pending,
                    )
                )
        dist.barrier()
        for g in [*chains, base_group]:
            dist.destroy_process_group(g)
    return rows


def _floors(status, world, pending, runtime, base_group) -> tuple[dict, dict[str, int]]:
    """The bare collective of each path on the same bytes (module docstring), and the
    bytes one rank sends per step on each path."""
    import torch
    import torch.distributed as dist

    from gramcoord.coordinator.agreement import CODECS
    from gramcoord.coordinator.status import PendingState

    pg = runtime.process_group("agreement")
    gather, reduce = CODECS["all_gather"](pending).size, CODECS["all_reduce"](pending).size
    sent = torch.zeros(world * gather, dtype=torch.int64)
    received = torch.empty_like(sent)
    band = torch.full((reduce,), -1, dtype=torch.int64)
    sets = tuple(
        {i for i, s in enumerate(status.states) if s == state}
        for state in (PendingState.READY, PendingState.FAILED)
    )
    blob = b"x" * len(pickle.dumps(sets))
    floors = {
        "all_gather_floor": functools.partial(dist.all_to_all_single, received, sent, group=pg),
        "all_reduce_floor": functools.partial(
            dist.all_reduce, band, op=dist.ReduceOp.BAND, group=pg
        ),
        "base_floor": functools.partial(
            dist.all_gather_object, [None] * world, blob, group=base_group
        ),
    }
    wire = {
        "all_gather": (world - 1) * gather * 8,
        "all_reduce": round(2 * (world - 1) / world * reduce * 8),
        "base": (world - 1) * (8 + len(blob)),
    }
    return floors, wire


def _hop_rows(rank, args):
    """pp=2: decision hop + ack vs 1-element ping + ack, over the same gloo group."""
    import torch
    import torch.distributed as dist

    from gramcoord.coordinator.config import DistributedConfig
    from gramcoord.coordinator.layout import ParallelLayout
    from gramcoord.coordinator.pipeline import Chain
    from gramcoord.coordinator.runtime import Runtime
    from gramcoord.coordinator.status import Decision

    layout = ParallelLayout(dp=1, pp=2, tp=1)
    rows = []
    with Runtime.attach(layout, distributed=DistributedConfig(step_timeout_s=60)) as runtime:
        pg = runtime.process_group("pp_chain")
        ack, ping = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        for pending in args.pending:
            prev, nxt = layout.chain_prev(rank), layout.chain_next(rank)
            chain = Chain(runtime, rank=rank, prev=prev, next=nxt, window=pending)
            half = pending // 2
            sent = (tuple(range(half)), tuple((i, 21) for i in range(half, pending)))
            counter = itertools.count(1)
            if rank == 0:

                def hop(counter=counter, chain=chain, sent=sent):
                    chain.send(Decision(step=next(counter), ready=sent[0], failed=sent[1]))
                    dist.recv(ack, src=1, group=pg, tag=99)
                    runtime.drain()

                def ping_fn():
                    dist.send(ping, dst=1, group=pg, tag=98)
                    dist.recv(ack, src=1, group=pg, tag=99)

            else:

                def hop(counter=counter, chain=chain):
                    got, _ = chain.receive(next(counter))
                    dist.send(ack, dst=0, group=pg, tag=99)
                    return got

                def ping_fn():
                    dist.recv(ping, src=0, group=pg, tag=98)
                    dist.send(ack, dst=0, group=pg, tag=99)

            def decisions(hop=hop, sent=sent):
                # Stage 1 must receive what stage 0 sent.
                got = hop()
                return {"sent": sent, "received": sent if rank == 0 else (got.ready, got.failed)}

            fns = {"hop": hop, "ping": ping_fn}
            times = _measure(rank, f"pp_hop, {pending} pending", fns, decisions, args.repeat)
            rows.append(dict(name="pp_hop", ours=times["hop"], base=times["ping"], pending=pending))
    return rows


def _acked(rank, last, step_fn, ack, pg):
    """``step_fn``, closed by the last stage's 1-element ack to stage 0."""
    import torch.distributed as dist

    def one():
        result = step_fn()
        if rank == last:
            dist.send(ack, dst=0, group=pg, tag=97)
        elif rank == 0:
            dist.recv(ack, src=last, group=pg, tag=97)
        return result

    return one


def _pp_sync_rows(rank, world, args):
    """dp=1 pp=world: chain vs collective pp_sync, each step closed by the last stage's ack."""
    import torch

    from gramcoord.coordinator.config import DistributedConfig
    from gramcoord.coordinator.coordinator import Coordinator
    from gramcoord.coordinator.layout import ParallelLayout
    from gramcoord.coordinator.runtime import Runtime

    runtimes = {}
    for mode in ("chain", "collective"):
        layout = ParallelLayout(dp=1, pp=world, tp=1, pp_sync=mode)
        cfg = DistributedConfig(step_timeout_s=60)
        runtimes[mode] = (layout, Runtime.attach(layout, distributed=cfg))
    ack = torch.zeros(1, dtype=torch.int64)
    last = world - 1
    rows = []
    for pending in args.pending:
        member = StaticMember(shared_status(pending))
        fns = {}
        for mode, (layout, runtime) in runtimes.items():
            coord = Coordinator(layout, runtime, window=pending, clock=lambda: 1)
            step, pg = _steps(coord, member, runtime), runtime.process_group("world")
            fns[mode] = _acked(rank, last, step, ack, pg)
        name = f"pp_sync_chain_pp{world}"

        def decisions(fns=fns):
            return {mode: _decided(fn()) for mode, fn in fns.items()}

        times = _measure(rank, f"{name}, {pending} pending", fns, decisions, args.repeat)
        for _, runtime in runtimes.values():
            runtime.drain()
        rows.append(dict(name=name, ours=times["chain"], base=times["collective"], pending=pending))
    for _, runtime in runtimes.values():
        runtime.close()
    return rows


def child(rank: int, world: int, args) -> list[dict]:
    """One rank of the gloo world (``run_procs`` target); every rank returns its rows."""
    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world)})
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rows = _layout_rows(rank, args, dp=world, pp=1)
    if world == 2:
        rows += _hop_rows(rank, args) + _pp_sync_rows(rank, world, args)
    elif world == 4:
        rows += _layout_rows(rank, args, dp=2, pp=2) + _pp_sync_rows(rank, world, args)
    dist.barrier()
    dist.destroy_process_group()
    return rows


# -- the parent: spawn the ranks, merge their rows -------------------------------


def _launch(world: int, args) -> list[dict]:
    # Spawned children import their module by its package name.
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    results = run_procs(
        "gramcoord.benchmarks.agreement:child",
        world,
        args=(args,),
        timeout=CHILD_TIMEOUT_S,
        env=env,
    )
    return _slowest([r.value for r in results])


def _slowest(per_rank: list[list[dict]]) -> list[dict]:
    """Merge every rank's rows: each timing is the slowest rank's median."""
    merged = []
    for rows in zip(*per_rank, strict=True):
        assert len({(r["name"], r["pending"]) for r in rows}) == 1, "ranks measured different rows"
        row = dict(rows[0])
        for key in row.keys() - {"name", "path", "pending"}:  # timings; a floor row's bytes
            row[key] = max(r[key] for r in rows)
        merged.append(row)
    return merged


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gramcoord bench agreement")
    ap.add_argument("--worlds", default="2,4,8", help="comma-separated world sizes")
    ap.add_argument("--pending", default="64,512", help="comma-separated pending counts")
    ap.add_argument("--repeat", type=int, default=41)
    args = ap.parse_args(argv)
    args.worlds = [int(x) for x in str(args.worlds).split(",")]
    args.pending = [int(x) for x in str(args.pending).split(",")]
    return args


def _record(row: dict, world: int) -> BenchRecord:
    name, pending = row["name"], row["pending"]
    cores = os.cpu_count() or 1
    where = (
        f"{world} ranks{' (oversubscribed)' if world > cores else ''}, {pending} pending "
        "(window = pending); slowest rank's median"
    )
    if "path" in row:
        return BenchRecord.compare(
            name,
            FLOORS[row["path"]][1],
            row["ours"],
            row["base"],
            note=f"{where}; bytes per rank per step: {row['bytes']}; ratio = floor / path "
            "(1 = no overhead)",
        )
    if name.startswith("agreement_reduce"):
        return BenchRecord.compare(
            name,
            "sglang_all_gather_object",
            row["ours"],
            row["base"],
            note=f"{where}; fixed-size all_reduce(BAND) report; all_gather step "
            f"{row['gather']:.3f} ms",
        )
    if name.startswith("agreement"):
        return BenchRecord.compare(
            name,
            "sglang_all_gather_object" + ("+send_object_list" if "pp2" in name else ""),
            row["ours"],
            row["base"],
            target=3.0,
            note=where,
        )
    if name == "pp_hop":
        return BenchRecord.compare(
            name,
            "gloo_ping_1elem",
            row["ours"],
            row["base"],
            target=round(1 / 1.5, 3),
            note=f"{where}; round trips with a 1-element ack; ratio = ping/hop, "
            f">= 0.667 means the hop is within 1.5x of a ping",
        )
    return BenchRecord.compare(
        name,
        "pp_sync_collective",
        row["ours"],
        row["base"],
        note=f"{where}; step until the last stage acks stage 0; ratio > 1: chain is faster",
    )


def run(args: list[str]) -> list[BenchRecord]:
    """Run every measurement for each world size; see the module docstring."""
    opts = _parse(args)
    records = []
    for world in opts.worlds:
        records += [_record(row, world) for row in _launch(world, opts)]
    return records
