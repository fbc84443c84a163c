"""One rank of ``gramcoord bench agreement``: what every rank of a gloo world measures.

``benchmarks/agreement.py`` spawns the ranks (``run_procs`` runs
:func:`child`) and merges their rows; its docstring says what is measured
and how. Each rank times every contender with
:func:`~gramcoord.benchmarks._contract.interleaved_ms` and, before and after
timing, checks that they all decided the same.
"""

from __future__ import annotations

import datetime
import functools
import os

from gramcoord.benchmarks._agreement_sglang import (
    StaticMember,
    local_status,
    sglang_step,
    shared_status,
)
from gramcoord.benchmarks._contract import interleaved_ms

__all__ = ["child"]


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
            status = local_status(pending, c.dp, dp)
            member = StaticMember(status)
            fns = {}
            for op in ("all_gather", "all_reduce") if pp == 1 else ("all_gather",):
                coord = Coordinator(
                    layout, runtime, window=pending, agreement_op=op, clock=lambda: 1
                )
                fns[op] = _steps(coord, member, runtime)
            fns["base"] = functools.partial(
                sglang_step, status, group, my_chain, peer, c.pp == 0, dp
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
            times = interleaved_ms(fns, args.repeat)
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
            times = interleaved_ms({"hop": hop, "ping": ping_fn}, args.repeat)
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
        member = StaticMember(shared_status(pending))
        fns = {}
        for mode, (layout, runtime) in runtimes.items():
            coord = Coordinator(layout, runtime, window=pending, clock=lambda: 1)
            pg = runtime.process_group("world")
            fns[mode] = _acked(rank, world - 1, _steps(coord, member, runtime), ack, pg)
        where = f"pp_sync_chain_pp{world}, {pending} pending"
        _check_same(rank, f"{where}, before timing", {m: _decided(f()) for m, f in fns.items()})
        times = interleaved_ms(fns, args.repeat)
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


def child(rank: int, world: int, args) -> list[dict]:
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
