"""What the journal costs a step: durable outputs against the same loop without them.

The step loop of one process (the reference topology, the shipped
workload, the synthetic model) runs several times in one session, journal
off and journal on alternating, after one warm-up run (so compiles are
cache hits in every measured run). Journal on: each finished request's
output line and its mask digests are written as the request ends
(``output.fsync_s`` 0.2, the default; the fsync thread runs beside).

Rows:

- ``journal_per_step``: the journal's own time per step (encode, frame,
  ``write``; measured around every call) against the whole step without a
  journal. Target: the journal under 2% of the step (ratio >= 50).
- ``step_with_journal``: ms per step with the journal against without,
  medians of the alternated runs. Target: within 2% (ratio >= 0.98). On
  two shared cores this row carries the machine's noise; the first row is
  the cost itself.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from gramcoord.benchmarks._contract import WORKLOAD, BenchRecord


class _Timed:
    """Wraps the journal's calls, adding up the time they take."""

    def __init__(self, journal) -> None:
        self.journal = journal
        self.ms = 0.0

    def output(self, record) -> None:
        t0 = time.perf_counter()
        self.journal.output(record)
        self.ms += (time.perf_counter() - t0) * 1e3

    def request_digests(self, rid, rows) -> None:
        t0 = time.perf_counter()
        self.journal.request_digests(rid, rows)
        self.ms += (time.perf_counter() - t0) * 1e3


def measure(rounds: int, repeat: int) -> dict:
    from gramcoord.engine.loop import run_loop
    from gramcoord.engine.models import make_model
    from gramcoord.engine.sampler import Sampler
    from gramcoord.launch.config import load_config
    from gramcoord.launch.journal import RankJournal, config_fingerprint, request_fingerprint
    from gramcoord.launch.rank_main import load_requests
    from gramcoord.rank_worker.grammars.tokenizer import load_tokenizer
    from gramcoord.rank_worker.session.session import RankSession, SessionConfig

    config = load_config(overrides=[f"workload.repeat={repeat}"])
    tokenizer = load_tokenizer(config.tokenizer)
    requests = load_requests(config, str(WORKLOAD))
    fp = config_fingerprint(config)
    fps = {r.request_id: request_fingerprint(fp, r) for r in requests}
    session = RankSession.local(tokenizer, SessionConfig.of(config))
    model, sampler = make_model(config.model, tokenizer), Sampler(config.sampling)
    per_step: dict[str, list[float]] = {"off": [], "on": []}
    journal_ms: list[float] = []
    lines = 0
    try:
        with tempfile.TemporaryDirectory(prefix="gramcoord-bench-journal-") as tmp:
            for i, mode in enumerate(["off"] + ["off", "on"] * rounds):
                journal = timed = None
                if mode == "on":
                    journal = RankJournal(
                        Path(tmp),
                        i,
                        0,
                        fsync_s=config.output.fsync_s,
                        fingerprints=fps,
                        outputs=True,
                        digests=True,
                    )
                    timed = _Timed(journal)
                t0 = time.perf_counter()
                report = run_loop(
                    session,
                    requests,
                    model,
                    sampler,
                    config.speculative,
                    on_output=timed.output if timed else None,
                    on_request_end=timed.request_digests if timed else None,
                )
                wall = (time.perf_counter() - t0) * 1e3
                if journal is not None:
                    journal.close()
                    lines = journal.lines
                if i == 0:
                    continue  # warm-up: compiles
                per_step[mode].append(wall / report.steps)
                if timed is not None:
                    journal_ms.append(timed.ms / report.steps)
    finally:
        session.close()
    return {
        "off": statistics.median(per_step["off"]),
        "on": statistics.median(per_step["on"]),
        "journal": statistics.median(journal_ms),
        "steps": report.steps,
        "requests": len(requests),
        "lines": lines,
        "rounds": rounds,
    }


def run(args: list[str]) -> list[BenchRecord]:
    p = argparse.ArgumentParser(prog="gramcoord bench journal")
    p.add_argument("--rounds", type=int, default=3, help="journal-off / journal-on pairs")
    p.add_argument("--repeat", type=int, default=2, help="passes over the shipped workload")
    opts = p.parse_args(args)
    m = measure(opts.rounds, opts.repeat)
    note = (
        f"one process, shipped workload x{opts.repeat} ({m['requests']} requests, "
        f"{m['steps']} steps), {m['lines']} journal lines per run, fsync every 0.2 s; medians "
        f"of {m['rounds']} alternated runs each after a warm-up; 2 shared cores"
    )
    return [
        BenchRecord.compare(
            "journal_per_step", "step_without_journal", m["journal"], m["off"], 50.0, note
        ),
        BenchRecord.compare(
            "step_with_journal", "step_without_journal", m["on"], m["off"], 0.98, note
        ),
    ]
