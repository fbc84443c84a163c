"""``gramcoord check``: compile a workload's specs on one process.

Each record gets one JSON line: ``{"id", "status": ok|invalid|timeout|
saturated|unconstrained, "code", "message", "warnings", "compile_ms", "cache"}``, in input
order. A spec that fails becomes an ``invalid`` line; nothing stops the
run. A workload whose records have the wrong shape is refused whole, before
anything compiles (``launch/workload.py``; the command exits 2).

xgrammar's C++ messages go to ``native-rank0.log``: beside ``--out FILE``
(in FILE's folder), or, when the lines go to stdout, in a fresh temporary
folder. An empty log is removed; a non-empty one is named on stderr.

Requests rejected with ``grammar_pool_saturated`` were never compiled, so
their verdict says nothing about the spec: check re-submits them once no
compile is stuck any more (up to ``retries`` times). Every round ends with
at least one more final verdict (a compile either finishes or times out),
so the loop terminates.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import IO

import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gramcoord.launch.config import ClusterConfig
from gramcoord.launch.workload import WorkloadRecord, load_workload
from gramcoord.rank_worker.grammars.manager import GrammarManager
from gramcoord.rank_worker.grammars.outcome import Outcome
from gramcoord.rank_worker.grammars.tokenizer import load_tokenizer
from gramcoord.rank_worker.native_log import native_stderr_redirected

_STATUS = {"grammar_timeout": "timeout", "grammar_pool_saturated": "saturated"}


class CheckLine(msgspec.Struct, kw_only=True):
    id: str
    status: str
    code: str | None
    message: str
    warnings: tuple[str, ...]
    compile_ms: float
    cache: str


class CheckSummary(msgspec.Struct, kw_only=True):
    records: int
    by_status: dict[str, int]
    by_code: dict[str, int]
    by_cache: dict[str, int]
    compiles: int
    compile_ms_p50: float
    compile_ms_p90: float
    compile_ms_p99: float
    wall_s: float


def _line(rec: WorkloadRecord, o: Outcome) -> CheckLine:
    status = "ok" if o.status == "admitted" else _STATUS.get(o.code or "", "invalid")
    return CheckLine(
        id=rec.id,
        status=status,
        code=o.code,
        message=o.message,
        warnings=o.warnings,
        compile_ms=o.compile_ms,
        cache=o.cache if o.cache != "none" else "miss",
    )


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return round(statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1], 3)


def summarize(lines: list[CheckLine], compiles: int, wall_s: float) -> CheckSummary:
    ms = [ln.compile_ms for ln in lines if ln.cache in ("miss",) and ln.compile_ms > 0]
    return CheckSummary(
        records=len(lines),
        by_status=dict(Counter(ln.status for ln in lines)),
        by_code=dict(Counter(ln.code for ln in lines if ln.code)),
        by_cache=dict(Counter(ln.cache for ln in lines)),
        compiles=compiles,
        compile_ms_p50=_pct(ms, 50),
        compile_ms_p90=_pct(ms, 90),
        compile_ms_p99=_pct(ms, 99),
        wall_s=round(wall_s, 3),
    )


def summary_table(s: CheckSummary) -> Table:
    table = Table(title=f"gramcoord check: {s.records} records in {s.wall_s:.1f}s")
    table.add_column("what")
    table.add_column("count / value", justify="right")
    for k in ("ok", "invalid", "timeout", "saturated", "unconstrained"):
        table.add_row(f"status {k}", str(s.by_status.get(k, 0)))
    for k, v in sorted(s.by_code.items(), key=lambda kv: -kv[1]):
        table.add_row(f"  code {k}", str(v))
    for k, v in sorted(s.by_cache.items()):
        table.add_row(f"cache {k}", str(v))
    table.add_row("compiles", str(s.compiles))
    table.add_row(
        "compile ms p50 / p90 / p99",
        f"{s.compile_ms_p50} / {s.compile_ms_p90} / {s.compile_ms_p99}",
    )
    return table


def run_check(
    config: ClusterConfig,
    workload: str,
    out: IO[bytes],
    *,
    console: Console | None = None,
    retries: int = 100,
    poll_s: float = 0.005,
) -> CheckSummary:
    """Compile every record of ``workload`` and write one line per record."""
    console = console or Console(stderr=True)
    t0 = time.perf_counter()
    records = load_workload(workload, config.workload.limit)
    manager = GrammarManager(config.grammar, load_tokenizer(config.tokenizer))
    results: dict[int, CheckLine] = {}
    live: dict[str, WorkloadRecord] = {}
    attempts: Counter[int] = Counter()
    retry: list[WorkloadRecord] = []

    def settle(rec: WorkloadRecord, o: Outcome) -> None:
        if o.code == "grammar_pool_saturated" and attempts[rec.index] <= retries:
            retry.append(rec)
            return
        results[rec.index] = _line(rec, o)

    def submit(rec: WorkloadRecord) -> None:
        attempts[rec.index] += 1
        rid = f"{rec.index}#{attempts[rec.index]}"
        o = manager.add(rid, rec.spec)
        if o.status == "failed":
            settle(rec, o)
        else:
            live[rid] = rec

    progress = Progress(
        TextColumn("check"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
    try:
        with progress:
            task = progress.add_task("compile", total=len(records))
            for rec in records:
                if rec.error is not None:
                    results[rec.index] = CheckLine(
                        id=rec.id,
                        status="invalid",
                        code="record_invalid",
                        message=rec.error,
                        warnings=(),
                        compile_ms=0.0,
                        cache="miss",
                    )
                elif not rec.constrained:
                    results[rec.index] = CheckLine(
                        id=rec.id,
                        status="unconstrained",
                        code=None,
                        message="no structured output: nothing to compile",
                        warnings=(),
                        compile_ms=0.0,
                        cache="none",
                    )
                else:
                    submit(rec)
            while live or retry:
                for o in manager.step():
                    settle(live.pop(o.request_id), o)
                    manager.release(o.request_id)
                if retry and manager.service.num_stuck() == 0:
                    pending, retry[:] = list(retry), []
                    for rec in pending:
                        submit(rec)
                progress.update(task, completed=len(results))
                if live or retry:
                    time.sleep(poll_s)
            progress.update(task, completed=len(results))
    finally:
        manager.close()
    lines = [results[r.index] for r in records]
    enc = msgspec.json.Encoder()
    for ln in lines:
        out.write(enc.encode(ln) + b"\n")
    out.flush()
    summary = summarize(lines, manager.service.num_compiles, time.perf_counter() - t0)
    console.print(summary_table(summary))
    return summary


def main_check(config: ClusterConfig, workload: str, out_path: str | None) -> int:
    """``gramcoord check``: lines to ``out_path`` (or stdout), the table to stderr."""
    # xgrammar's C++ warnings go to a log file, not the console; the ones a
    # request can own are in its line's warnings already.
    logs = (
        Path(out_path).resolve().parent
        if out_path
        else Path(tempfile.mkdtemp(prefix="gramcoord-check-"))
    )
    with native_stderr_redirected(logs, 0) as native:
        if out_path:
            with open(out_path, "wb") as out:
                run_check(config, workload, out)
        else:
            run_check(config, workload, sys.stdout.buffer)
    if native.stat().st_size:
        print(f"native library messages: {native}", file=sys.stderr)
    elif out_path:
        native.unlink()
    else:
        shutil.rmtree(logs)
    return 0
