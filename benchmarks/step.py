"""End-to-end step cost: ours against SGLang- and vLLM-style paths, dp=2 x tp=2.

``gramcoord bench step`` starts a gloo world of four ranks (2 data-parallel
replicas x 2 tensor-parallel ranks) and runs the same workload through it
three ways, one after the other in the same processes (``_step_ranks.py``):

- **ours**: ``RankSession`` + the step loop ``gramcoord run`` runs;
- **SGLang-style** (``_step_sglang.py``): every TP rank schedules, compiles
  and fills its own masks; arrivals are broadcast pickled each iteration,
  readiness agreed with ``all_gather_object`` of index sets, sampled ids
  made equal with an ``all_reduce(MIN)``;
- **vLLM-style** (``_step_vllm.py``): TP rank 0 is the engine core: it
  compiles and fills; the scheduler output and then the bitmask go to the
  TP peer pickled through vLLM's own shared-memory broadcast queue. Needs
  vLLM (``.venv-vllm``); without it its rows are skipped, each saying so.

Same synthetic model, greedy sampling, xgrammar compiler settings and
requests (the json / regex records of ``configs/workload.jsonl`` ours
admits; ``--copies`` repeats them under new ids, ``--max-tokens`` caps the
outputs). All three fill on a thread while the forward runs. Each way runs
``--rounds`` times in rotating order, then the floor
(``_step_ranks.py``: one bare xgrammar fill of the run's own batches
+ one memcpy of the rows + one gloo 1-element round trip between the TP
ranks).

Per step, on every rank (``_step_common.RunClock``): **overhead** = the gap
between two forward calls minus the forward (everything but the model);
**coordination** = overhead minus the logits work every way does alike
(xgrammar's mask kernel and the greedy pick, which on CPU cost more than
anything else). Figure = the slowest rank's median over the steps with rows.
Records ``step_{overhead,coordination}_vs_{sglang,vllm}`` (target >= 2x)
and ``..._vs_floor`` (floor / ours, target >= 0.833: ours within 1.2x of
the floor). The outputs (status, finish reason, token ids per request) of
every way and round must be identical; otherwise the bench raises.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from pathlib import Path

from gramcoord.benchmarks._contract import WORKLOAD, BenchRecord
from gramcoord.benchmarks._step_common import bench_requests, forward_ms, step_samples_ms
from gramcoord.benchmarks._step_ranks import DP, TP, WorldOptions
from gramcoord.launch.procs import run_ranks

FLOOR_TARGET = round(1 / 1.2, 3)
KINDS = {
    "overhead": "step wall minus forward",
    "coordination": "step wall minus forward, mask kernel and greedy pick",
}


class OutputsDiffer(RuntimeError):
    """The ways (or rounds) did not produce the same outputs."""


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gramcoord bench step")
    p.add_argument("--workload", type=Path, default=WORKLOAD)
    p.add_argument("--limit", type=int, default=0, help="first N usable records (0 = all)")
    p.add_argument("--copies", type=int, default=1, help="repeat the records under new ids")
    p.add_argument(
        "--max-tokens", type=int, default=0, help="cap every request's output (0 = the record's)"
    )
    p.add_argument("--rounds", type=int, default=2, help="runs of each way (order rotates)")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of the whole world")
    return p.parse_args(argv)


def _diff(a, b) -> str:
    if a is None or b is None:
        return "missing" if b is None else "extra"
    if (a.status, a.finish_reason) != (b.status, b.finish_reason):
        return f"{b.status}/{b.finish_reason} instead of {a.status}/{a.finish_reason}"
    i = next(
        (j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
        min(len(a.token_ids), len(b.token_ids)),
    )
    return f"token ids differ first at position {i} ({len(b.token_ids)} vs {len(a.token_ids)})"


def check_outputs(by_way: dict[str, list[dict]]) -> tuple[int, int]:
    """(requests, tokens) of the reference; raises ``OutputsDiffer`` on any difference."""
    (ref_way, (ref, *_)), *_ = by_way.items()
    diffs = [
        f"{way} (round {i}) vs {ref_way}, request {rid!r}: {_diff(ref.get(rid), got.get(rid))}"
        for way, rounds in by_way.items()
        for i, got in enumerate(rounds)
        for rid in sorted(ref.keys() | got.keys())
        if ref.get(rid) != got.get(rid)
    ]
    if diffs:
        raise OutputsDiffer(f"{len(diffs)} output difference(s); first: " + "; ".join(diffs[:3]))
    return len(ref), sum(len(o.token_ids) for o in ref.values())


class WayStats:
    """One way's samples, every round pooled per rank."""

    def __init__(self, runs: list) -> None:
        # kind ("overhead" | "coordination") -> rank -> per-step ms.
        self.per_rank: dict[str, dict[int, list[float]]] = {k: {} for k in KINDS}
        self.forward, self.rows, self.parts, rounds = [], [], {}, {}
        for run in runs:
            rounds.setdefault(run.rank, []).append(run.outputs)
            for sample in step_samples_ms(run):
                for kind, ms in zip(KINDS, sample):
                    self.per_rank[kind].setdefault(run.rank, []).append(ms)
            self.forward += forward_ms(run.calls)
            self.rows += [n for _, _, n in run.calls if n]
            for name, values in run.timings.items():
                if name != "forward":
                    self.parts.setdefault(name, []).extend(values)
        # Per round, every rank's outputs (stage-0 leaders hold them).
        self.outputs = [
            {k: v for o in outs for k, v in o.items()} for outs in zip(*rounds.values())
        ]

    def slowest(self, kind: str) -> float:
        """The largest per-rank median of ``kind`` per step."""
        return max(statistics.median(v) for v in self.per_rank[kind].values() if v)

    def describe(self) -> str:
        def medians(kind: str) -> str:
            return "/".join(
                f"{statistics.median(v):.2f}" for _, v in sorted(self.per_rank[kind].items())
            )

        steps = max(len(v) for v in self.per_rank["overhead"].values())
        parts = ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in sorted(self.parts.items()))
        return (
            f"ranks 0/1/2/3 overhead {medians('overhead')}, coordination "
            f"{medians('coordination')}; {steps} steps, median {statistics.median(self.rows):g} "
            f"rows, forward {statistics.median(self.forward):.2f}"
            + (f"; loop timings {parts}" if parts else "")
        )


def way_records(results: list, opts: WorldOptions) -> list[BenchRecord]:
    """Ours against the SGLang- and vLLM-style ways and against the floor, after
    checking that every way and round produced the same outputs."""
    stats = {
        way: WayStats([run for res in results for run in res.runs if run.way == way])
        for way in opts.ways
    }
    n_req, n_tok = check_outputs({w: s.outputs for w, s in stats.items()})
    setup = (
        f"dp={DP} tp={TP} gloo, {n_req} requests x {opts.rounds} round(s), {n_tok} tokens, "
        "outputs identical across ways; ms per step, slowest rank's median; 2 shared cores"
    )
    ours = stats["ours"]
    floors = [res.floor for res in results if res.floor is not None and res.floor.ping_ms]
    worst = max(floors, key=lambda f: f.floor_ms())
    floor_note = (
        f"floor of the costlier replica (rank {worst.rank}): bare fill "
        f"{statistics.median(worst.fill_ms):.3f} + memcpy {statistics.median(worst.memcpy_ms):.3f}"
        f" ms (medians over {len(worst.fill_ms)} replayed batches of the run, median "
        f"{statistics.median(worst.rows):g} rows) + gloo 1-element round trip "
        f"{statistics.median(worst.ping_ms):.3f} ms; ratio >= {FLOOR_TARGET}: ours within 1.2x"
    )
    out = []
    for kind, what in KINDS.items():
        for way, label in (("sglang", "sglang_style"), ("vllm", "vllm_style")):
            name, baseline = f"step_{kind}_vs_{way}", f"{label}_step_{kind}"
            if way not in stats:
                out.append(BenchRecord.needs_vllm(name, baseline, "step", target=2.0))
                continue
            out.append(
                BenchRecord.compare(
                    name,
                    baseline,
                    ours.slowest(kind),
                    stats[way].slowest(kind),
                    target=2.0,
                    note=f"{kind} = {what}; {setup}. ours: {ours.describe()}. {way}: "
                    f"{stats[way].describe()}",
                )
            )
        out.append(
            BenchRecord.compare(
                f"step_{kind}_vs_floor",
                "fill_memcpy_ping_floor",
                ours.slowest(kind),
                worst.floor_ms(),
                target=FLOOR_TARGET,
                note=f"{kind} = {what}; {floor_note}",
            )
        )
    return out


def run(args: list[str]) -> list[BenchRecord]:
    a = _args(args)
    kw = dict(limit=a.limit, copies=a.copies, max_tokens=a.max_tokens)
    requests = bench_requests(a.workload, **kw)
    if not requests:
        raise SystemExit(f"no usable json / regex records in {a.workload}")
    opts = WorldOptions(
        workload=str(a.workload),
        **kw,
        # Every request of a replica fits one batch.
        max_num_seqs=-(-len(requests) // DP),
        rounds=a.rounds,
        step_timeout_s=60.0,
        ways=("ours", "sglang", "vllm") if importlib.util.find_spec("vllm") else ("ours", "sglang"),
    )
    results = run_ranks(
        "gramcoord.benchmarks._step_ranks:child", DP * TP, args=(opts,), timeout=a.timeout
    )
    return way_records([r.value for r in results], opts)
