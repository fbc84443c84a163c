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

- every rank times every contender (``interleaved_ms``: alternating rounds of
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

from gramcoord.benchmarks._contract import BenchRecord
from gramcoord.launch.ports import free_port
from gramcoord.launch.procs import run_procs

CHILD_TIMEOUT_S = 600


def _launch(world: int, args) -> list[dict]:
    # Spawned children import their module by its package name.
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    results = run_procs(
        "gramcoord.benchmarks._agreement_ranks:child",
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
