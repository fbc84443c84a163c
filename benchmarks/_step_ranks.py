"""One rank of ``gramcoord bench step``: every run, then the floor.

``gramcoord.launch.procs.run_ranks`` starts the dp=2 x tp=2 gloo world
once; each rank then runs every way in turn (ours with each fill strategy,
SGLang-style, vLLM-style), a world barrier between runs, so all of them
share the processes, the warm imports and the machine's state. One untimed
run of the first way comes before them; with several rounds the order
rotates, so load drift hits every way alike. The floor comes last,
replaying the first timed run of ours.
"""

from __future__ import annotations

import datetime

import msgspec
import torch.distributed as dist

from gramcoord.benchmarks._step_common import KERNEL_HOOK, RankRun, bench_requests
from gramcoord.benchmarks._step_lower_bound import FloorRun, measure_floor
from gramcoord.benchmarks._step_ours import run_ours
from gramcoord.benchmarks._step_sglang import run_sglang
from gramcoord.benchmarks._step_vllm import run_vllm
from gramcoord.engine.models import SyntheticModel, vocab_index
from gramcoord.rank_worker.grammars.tokenizer import load_tokenizer

DP, TP = 2, 2


class WorldOptions(msgspec.Struct, frozen=True, kw_only=True):
    workload: str
    limit: int
    copies: int
    max_tokens: int
    max_num_seqs: int
    rounds: int
    # "ours_<strategy>", "sglang", "vllm"; the first must be ours.
    ways: tuple[str, ...]
    step_timeout_s: float
    # End every forward with a 1-element all_reduce on the TP group.
    sync_forward: bool = False
    # Names the runs' shared-memory segments and sockets ("" = a fresh id per run).
    run_id: str = ""
    # Measure the floor after the runs (replaying the first run of ours).
    floor: bool = True


class WorldResult(msgspec.Struct, kw_only=True):
    runs: list[RankRun]
    floor: FloorRun | None


def _run(way: str, tokenizer, requests, opts: WorldOptions, rank: int, tp_groups) -> RankRun:
    if way.startswith("ours_"):
        return run_ours(
            tokenizer,
            requests,
            strategy=way.removeprefix("ours_"),
            max_num_seqs=opts.max_num_seqs,
            step_timeout_s=opts.step_timeout_s,
            tp_group=tp_groups[rank // TP] if opts.sync_forward else None,
            run_id=opts.run_id,
        )
    kw = dict(
        rank=rank,
        dp=DP,
        tp=TP,
        tp_groups=tp_groups,
        max_num_seqs=opts.max_num_seqs,
        sync_forward=opts.sync_forward,
    )
    if way == "sglang":
        return run_sglang(tokenizer, requests, **kw)
    if way == "vllm":
        return run_vllm(
            tokenizer, requests, timeout_s=opts.step_timeout_s, run_id=opts.run_id, **kw
        )
    raise ValueError(f"unknown way {way!r}")


def child(rank: int, world: int, opts: WorldOptions) -> WorldResult:
    """Entry of every rank (``run_ranks`` made the gloo world)."""
    assert world == DP * TP, world
    tokenizer = load_tokenizer()
    requests = bench_requests(
        opts.workload, limit=opts.limit, copies=opts.copies, max_tokens=opts.max_tokens
    )
    KERNEL_HOOK.install()
    # Lazy per-process tables, built before anything is timed.
    vocab_index(tokenizer)
    SyntheticModel(tokenizer).logits([])
    timeout = datetime.timedelta(seconds=opts.step_timeout_s)
    tp_groups = [
        dist.new_group(list(range(d * TP, (d + 1) * TP)), backend="gloo", timeout=timeout)
        for d in range(DP)
    ]
    # One untimed run first: the first run in a process pays for page
    # faults on fresh logits buffers and lazy set-up, which would bias
    # whichever way happened to go first.
    dist.barrier()
    _run(opts.ways[0], tokenizer, requests, opts, rank, tp_groups)
    runs: list[RankRun] = []
    first = None
    for r in range(opts.rounds):
        ways = opts.ways[r % len(opts.ways) :] + opts.ways[: r % len(opts.ways)]
        for way in ways:
            dist.barrier()
            run = _run(way, tokenizer, requests, opts, rank, tp_groups)
            runs.append(run)
            if first is None and way == opts.ways[0]:
                first = run
    assert first is not None
    floor = None
    if opts.floor:
        dist.barrier()
        floor = measure_floor(
            tokenizer,
            requests,
            rank=rank,
            tp=TP,
            tp_groups=tp_groups,
            batches=first.batches,
            outputs=first.outputs,
        )
    dist.barrier()
    for g in tp_groups:
        dist.destroy_process_group(g)
    return WorldResult(runs=runs, floor=floor)
