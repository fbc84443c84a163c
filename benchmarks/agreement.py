"""Agreement, PP hop and pp_sync cost against SGLang-style baselines, over gloo.

``gramcoord bench agreement`` (or ``run_bench('agreement', [], out)``) starts
its own ranks: for each world size it spawns that many ranks through
``gramcoord.launch.procs``, which build gloo worlds on 127.0.0.1 with a free
port and measure, side by side in one run:

- ``agreement``: one coordinator step of a replicated group (encode, one
  collective, combine, decide, apply) against SGLang's way: pickled
  ``all_gather_object`` of the ready/failed index sets, then set
  intersection/union. With ``pp=2`` both also carry the decision to stage 1
  (ours: one tensor send; SGLang: ``send_object_list``). Target >= 3x.
- ``agreement_reduce``: the same step with the fixed-size ``all_reduce(BAND)``
  report (reported only).
- ``pp_hop``: round trip of one decision hop plus a 1-element ack, against a
  1-element gloo ping plus the same ack. Ratio convention: ping / hop, so
  "hop within 1.5x of a ping" is ratio >= 1/1.5 = 0.667.
- ``pp_sync_chain``: a pipeline step with the decision sent down the chain,
  against ``pp_sync: collective`` (every stage leader in one all_gather);
  both end with the last stage's 1-element ack to stage 0. Reported only.

Each pending request's local state is fixed: half ready, a quarter pending,
a quarter failed, and on each DP member a few requests that others see
ready are still pending or failed there, so the intersection and union
matter. Every step decides the same non-trivial outcome.

How it is measured, the same way for ours and the baseline:

- every rank times every contender (``_interleaved``: alternating rounds of
  short medians); each figure is the slowest rank's median;
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
import os
import statistics
import sys

from gramcoord.benchmarks._contract import BenchRecord, median_ms
from gramcoord.launch.procs import free_port, run_procs

CHILD_TIMEOUT_S = 600


# -- child side -----------------------------------------------------------------


class _StaticMember:
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


def _status(pending: int):
    from gramcoord.coordinator.status import LocalStatus, PendingState

    states = [
        (PendingState.READY, PendingState.READY, PendingState.PENDING, PendingState.FAILED)[i % 4]
        for i in range(pending)
    ]
    reasons = [21 if s == PendingState.FAILED else 0 for s in states]
    return LocalStatus(
        seqs=tuple(range(1000, 1000 + pending)), states=tuple(states), reasons=tuple(reasons)
    )


def _local_status(pending: int, member: int, members: int):
    """``_status`` with a few requests of this DP member still pending or failed."""
    from gramcoord.coordinator.status import LocalStatus, PendingState

    base = _status(pending)
    states, reasons = list(base.states), list(base.reasons)
    for i in range(pending):
        if i % (4 * members) == 4 * member:  # ready elsewhere, still pending here
            states[i] = PendingState.PENDING
        elif i % (4 * members) == 4 * member + 1:  # ready elsewhere, failed here
            states[i], reasons[i] = PendingState.FAILED, 30 + member % 30
    return LocalStatus(seqs=base.seqs, states=tuple(states), reasons=tuple(reasons))


def _sglang_step(status, group, chain_group, chain_peer, is_sender, world):
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


def _interleaved(fns: dict, repeat: int) -> dict[str, float]:
    """Median ms of each function, measured in alternating rounds of ``median_ms``.

    The machine is shared, so load drifts; alternating short rounds puts every
    contender under the same drift. Every rank runs the same sequence.
    """
    rounds = max(3, repeat // 5)
    per: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            per[name].append(median_ms(fn, repeat=5, warmup=1))
    return {name: statistics.median(v) for name, v in per.items()}


def _steps(coord, member, runtime):
    """One coordinator step per call, its asynchronous chain send drained."""
    counter = iter(range(1, 10**9))

    def one():
        result = coord.step(next(counter), member)
        runtime.drain()
        return result

    return one


def _decided(result) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Ready and failed sequence numbers of one of our steps (a ``StepResult``)."""
    decision = result.decision
    return tuple(sorted(decision.ready)), tuple(sorted(s for s, _ in decision.failed))


def _check_same(rank: int, where: str, decisions: dict) -> None:
    """Stop the bench unless every contender reached the same decision on this rank."""
    if len(set(decisions.values())) != 1:
        sizes = {k: (len(r), len(f)) for k, (r, f) in decisions.items()}
        raise RuntimeError(
            f"rank {rank}, {where}: contenders decided differently ((ready, failed) counts {sizes})"
        )


def _layout_rows(rank, world, args, dp, pp):
    """Our step (gather, and reduce when pp=1) vs the SGLang-style step, dp x pp replicated."""
    import torch.distributed as dist

    from gramcoord.coordinator.config import DistributedConfig
    from gramcoord.coordinator.coordinator import Coordinator
    from gramcoord.coordinator.layout import ParallelLayout
    from gramcoord.coordinator.runtime import Runtime

    layout = ParallelLayout(dp=dp, pp=pp, tp=1, requests="replicated")
    timeout = datetime.timedelta(seconds=60)
    rows = []
    with Runtime.attach(layout, distributed=DistributedConfig(step_timeout_s=60)) as runtime:
        # Baseline groups: the same members, their own gloo groups.
        leaders = list(layout.dp_leaders())
        base_group = dist.new_group(leaders, backend="gloo", timeout=timeout)
        chains = [
            dist.new_group(list(c), backend="gloo", timeout=timeout) for c in layout.pp_chains()
        ]
        c = layout.coords(rank)
        my_chain = chains[c.dp] if pp > 1 else None
        peer = layout.chain_next(rank) if c.pp == 0 else layout.chain_prev(rank)
        group = base_group if rank in leaders and dp > 1 else None
        for pending in args.pending:
            status = _local_status(pending, c.dp, dp)
            member = _StaticMember(status)
            fns = {}
            for op in ("all_gather", "all_reduce") if pp == 1 else ("all_gather",):
                coord = Coordinator(
                    layout, runtime, window=pending, agreement_op=op, clock=lambda: 1
                )
                fns[op] = _steps(coord, member, runtime)
            fns["base"] = functools.partial(
                _sglang_step, status, group, my_chain, peer, c.pp == 0, dp
            )
            name = f"agreement_dp{dp}_pp{pp}"

            def check(when, fns=fns, status=status, name=name, pending=pending):
                seqs = status.seqs
                got = {op: _decided(fns[op]()) for op in fns if op != "base"}
                ready, failed = fns["base"]()
                got["base"] = (
                    tuple(sorted(seqs[i] for i in ready)),
                    tuple(sorted(seqs[i] for i in failed)),
                )
                _check_same(rank, f"{name}, {pending} pending, {when} timing", got)

            check("before")
            times = _interleaved(fns, args.repeat)
            check("after")
            rows.append(
                dict(name=name, ours=times["all_gather"], base=times["base"], pending=pending)
            )
            if "all_reduce" in times:
                rows.append(
                    dict(
                        name=f"agreement_reduce_dp{dp}_pp{pp}",
                        ours=times["all_reduce"],
                        base=times["base"],
                        gather=times["all_gather"],
                        pending=pending,
                    )
                )
        dist.barrier()
        for g in chains:
            dist.destroy_process_group(g)
        dist.destroy_process_group(base_group)
    return rows


def _hop_fns(rank, runtime, chain, decision, pg, ack, ping):
    import torch.distributed as dist

    from gramcoord.coordinator.status import Decision

    counter = iter(range(1, 10**9))
    if rank == 0:

        def hop():
            step = next(counter)
            chain.send(Decision(step=step, ready=decision.ready, failed=decision.failed))
            dist.recv(ack, src=1, group=pg, tag=99)
            runtime.drain()
            return None

        def ping_fn():
            dist.send(ping, dst=1, group=pg, tag=98)
            dist.recv(ack, src=1, group=pg, tag=99)

    else:

        def hop():
            got, _ = chain.receive(next(counter))
            dist.send(ack, dst=0, group=pg, tag=99)
            return got

        def ping_fn():
            dist.recv(ping, src=0, group=pg, tag=98)
            dist.send(ack, dst=0, group=pg, tag=99)

    return hop, ping_fn


def _hop_rows(rank, args):
    """pp=2: decision hop + ack vs 1-element ping + ack, over the same gloo group."""
    import torch

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
            chain = Chain(
                runtime,
                rank=rank,
                prev=layout.chain_prev(rank),
                next=layout.chain_next(rank),
                window=pending,
            )
            half = pending // 2
            decision = Decision(
                step=0,
                ready=tuple(range(half)),
                failed=tuple((i, 21) for i in range(half, pending)),
            )
            hop, ping_fn = _hop_fns(rank, runtime, chain, decision, pg, ack, ping)

            def check(when, hop=hop, decision=decision, pending=pending):
                got = hop()
                if rank == 1 and (got.ready, got.failed) != (decision.ready, decision.failed):
                    raise RuntimeError(
                        f"pp_hop, {pending} pending, {when} timing: stage 1 received "
                        "another decision than stage 0 sent"
                    )

            check("before")
            times = _interleaved({"hop": hop, "ping": ping_fn}, args.repeat)
            check("after")
            rows.append(dict(name="pp_hop", ours=times["hop"], base=times["ping"], pending=pending))
    return rows


def _acked(rank, last, step_fn, ack, pg):
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
    rows = []
    for pending in args.pending:
        member = _StaticMember(_status(pending))
        fns = {}
        for mode, (layout, runtime) in runtimes.items():
            coord = Coordinator(layout, runtime, window=pending, clock=lambda: 1)
            pg = runtime.process_group("world")
            fns[mode] = _acked(rank, world - 1, _steps(coord, member, runtime), ack, pg)
        where = f"pp_sync_chain_pp{world}, {pending} pending"
        _check_same(rank, f"{where}, before timing", {m: _decided(f()) for m, f in fns.items()})
        times = _interleaved(fns, args.repeat)
        _check_same(rank, f"{where}, after timing", {m: _decided(f()) for m, f in fns.items()})
        for _, runtime in runtimes.values():
            runtime.drain()
        rows.append(
            dict(
                name=f"pp_sync_chain_pp{world}",
                ours=times["chain"],
                base=times["collective"],
                pending=pending,
            )
        )
    for _, runtime in runtimes.values():
        runtime.close()
    return rows


def _child(rank: int, world: int, args) -> list[dict]:
    """One rank of the gloo world (``run_procs`` target); every rank returns its rows."""
    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world)})
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rows = []
    if world == 2:
        rows += _layout_rows(rank, world, args, dp=2, pp=1)
        rows += _hop_rows(rank, args)
        rows += _pp_sync_rows(rank, world, args)
    else:
        rows += _layout_rows(rank, world, args, dp=world, pp=1)
        rows += _layout_rows(rank, world, args, dp=world // 2, pp=2)
        rows += _pp_sync_rows(rank, world, args)
    dist.barrier()
    dist.destroy_process_group()
    return rows


# -- parent side ----------------------------------------------------------------


def _launch(world: int, args) -> list[dict]:
    # Spawned children import this module by its package name.
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    results = run_procs(
        "gramcoord.benchmarks.agreement:_child",
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
        for key in ("ours", "base", "gather"):
            if key in row:
                row[key] = max(r[key] for r in rows)
        merged.append(row)
    return merged


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gramcoord bench agreement")
    ap.add_argument("--worlds", default="2,4", help="comma-separated world sizes")
    ap.add_argument("--pending", default="64,512", help="comma-separated pending counts")
    ap.add_argument("--repeat", type=int, default=41)
    args = ap.parse_args(argv)
    args.worlds = [int(x) for x in str(args.worlds).split(",")]
    args.pending = [int(x) for x in str(args.pending).split(",")]
    return args


def _record(row: dict, world: int) -> BenchRecord:
    name, pending = row["name"], row["pending"]
    where = f"{world} ranks, {pending} pending (window = pending); slowest rank's median"
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


if __name__ == "__main__":
    from gramcoord.benchmarks._contract import format_table

    print(format_table(run(sys.argv[1:])))
