"""The per-rank program: every launcher runs ``entry`` in each rank.

``entry(job)`` takes a msgpack-encoded ``RankJob`` (the resolved config and
paths), reads ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``
from the environment, builds the rank's session, runs the step loop, and
gathers every rank's report on rank 0, which writes ``outputs.jsonl``,
``digests.jsonl`` and ``summary.json`` and returns the encoded summary.

Run by hand under your own ``torchrun`` (``launcher: external``: this
program plays the host that makes the process group, as an RL framework
would)::

    torchrun --nproc-per-node 2 -m gramcoord.launch.rank_main CONFIG [--set k=v ...]

Exit status there: 0 done, 1 infrastructure failure, 2 config, 3 a
determinism mismatch.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import msgspec

from gramcoord.engine.loop import RankReport, run_loop
from gramcoord.engine.models import make_model
from gramcoord.engine.requests import EngineRequest
from gramcoord.engine.sampler import Sampler
from gramcoord.launch import stack_dump
from gramcoord.launch.config import ClusterConfig, ConfigError, load_config
from gramcoord.launch.failures import backend_problem
from gramcoord.launch.journal import (
    JOURNAL,
    PriorRun,
    RankJournal,
    carried_poison,
    config_fingerprint,
    read_prior,
    request_fingerprint,
)
from gramcoord.launch.progress import ProgressWriter, local_bar
from gramcoord.launch.resources import ResourceProbe
from gramcoord.launch.summary import Summary, digests_by_request, merge, write_run
from gramcoord.launch.workload import stream_workload
from gramcoord.rank_worker.config import FaultsConfig
from gramcoord.rank_worker.grammars.tokenizer import load_tokenizer
from gramcoord.rank_worker.native_log import native_stderr_redirected
from gramcoord.rank_worker.session.session import RankSession, SessionConfig

logger = logging.getLogger("gramcoord.rank")

ENTRY = "gramcoord.launch.rank_main:entry"


class RankJob(msgspec.Struct, frozen=True, kw_only=True):
    config: ClusterConfig
    workload: str
    out_dir: str
    run_id: str
    # Under the user's own launcher: rank 0 draws a progress bar on its
    # stderr when that is a terminal.
    progress: bool = True
    # The launcher's progress channel (``gramcoord.launch.progress``); set by
    # ``gramcoord run``, which draws the bar itself.
    progress_dir: str = ""
    # The journal attempt this launch starts at: 0 for a new run (its old
    # journal is cleared), the number of earlier attempts for ``--resume``.
    # An elastic restart adds TORCHELASTIC_RESTART_COUNT.
    attempt: int = 0


def restart_count() -> int:
    """How often torch's elastic agent restarted this group (0 on the first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def load_requests(config: ClusterConfig, path: str) -> list[EngineRequest]:
    """The workload's records as engine requests, in file order."""
    out = []
    w = config.workload
    stream = stream_workload(
        path, limit=w.limit, repeat=w.repeat, mix_path=w.mix_path or None, mix_every=w.mix_every
    )
    for rec in stream:
        rid, error = rec.id, rec.error
        try:
            rid.encode("utf-8")
        except UnicodeEncodeError:
            rid = rid.encode("utf-8", "backslashreplace").decode("utf-8")
            error = error or "the request id does not encode as UTF-8 (lone surrogate)"
        # Repeated ids were renamed ``ID@lineN`` and failed by the reader.
        out.append(
            EngineRequest(
                request_id=rid,
                spec=rec.spec,
                constrained=rec.constrained,
                prompt=rec.prompt,
                max_tokens=rec.max_tokens or config.workload.max_tokens,
                reference=rec.reference,
                error=error,
            )
        )
    return out


class _RankLogs:
    """This rank's log file (and the native stderr log), for the run's duration."""

    def __init__(self, out_dir: Path, rank: int) -> None:
        logs = out_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.handler = logging.FileHandler(logs / f"rank{rank}.log")
        self.handler.setFormatter(
            logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
        )
        self.logs, self.rank = logs, rank

    def __enter__(self) -> _RankLogs:
        root = logging.getLogger()
        self._level = root.level
        # The console keeps warnings only; the file takes the rank's INFO.
        self._levels = [(h, h.level) for h in root.handlers]
        for h in root.handlers:
            if h.level < logging.WARNING:
                h.setLevel(logging.WARNING)
        root.addHandler(self.handler)
        self.console = None
        if not root.handlers[:-1]:  # a rank process of its own: name the rank on stderr too
            self.console = logging.StreamHandler(sys.stderr)
            self.console.setLevel(logging.WARNING)
            self.console.setFormatter(
                logging.Formatter(f"gramcoord rank{self.rank} %(levelname)s %(name)s: %(message)s")
            )
            root.addHandler(self.console)
        root.setLevel(min(self._level or logging.WARNING, logging.INFO))
        self._native = native_stderr_redirected(self.logs, self.rank)
        self._native.__enter__()
        # ``kill -USR1`` writes every thread's stack here: where a stuck rank waits.
        stack_dump.arm(self.logs / f"rank{self.rank}.stacks")
        return self

    def failure(self, exc: BaseException) -> None:
        """The whole traceback of what ended the rank, in its log file only
        (the console gets one line: ``gramcoord.launch.failures``)."""
        record = logger.makeRecord(
            logger.name,
            logging.ERROR,
            __file__,
            0,
            "rank %d failed: %s: %s",
            (self.rank, type(exc).__name__, exc),
            (type(exc), exc, exc.__traceback__),
        )
        self.handler.handle(record)

    def __exit__(self, *exc: object) -> None:
        stack_dump.disarm()
        self._native.__exit__(*exc)
        root = logging.getLogger()
        root.removeHandler(self.handler)
        for h, level in self._levels:
            h.setLevel(level)
        if self.console is not None:
            root.removeHandler(self.console)
        root.setLevel(self._level)
        self.handler.close()


def _progress(job: RankJob, rank: int):
    """(bar, callback): counts to the launcher's channel, or rank 0's own bar.

    Under a launcher of ours every rank gets a writer (only stage-0 leaders
    call it); under the user's own torchrun rank 0 draws its replica's count
    itself, on a terminal only (``gramcoord.launch.progress``).
    """
    if job.progress_dir:
        return None, ProgressWriter(job.progress_dir, rank)
    if job.progress and rank == 0:
        return local_bar()
    return None, None


def _session(config: ClusterConfig, tokenizer, rank: int, run_id: str) -> RankSession:
    sc = SessionConfig.of(config)
    if config.launcher == "inline" or (
        config.parallel.world_size == 1 and "RANK" not in os.environ
    ):
        return RankSession.local(tokenizer, sc)
    if config.launcher == "external":
        import torch.distributed as dist

        if not dist.is_initialized():  # this program plays the host
            dist.init_process_group(
                config.distributed.backend,
                init_method="env://",
                timeout=__import__("datetime").timedelta(seconds=config.distributed.init_timeout_s),
            )
        return RankSession.attach(tokenizer, sc, run_id=run_id)
    addr = os.environ.get("MASTER_ADDR")
    if addr:
        sc = msgspec.structs.replace(
            sc, distributed=msgspec.structs.replace(sc.distributed, master_addr=addr)
        )
    return RankSession.start(tokenizer, sc, rank=rank, run_id=run_id)


def run_rank(job: RankJob) -> Summary | None:
    """This rank's whole run; rank 0 returns the summary, the others ``None``."""
    rank = int(os.environ.get("RANK", "0"))
    with _RankLogs(Path(job.out_dir), rank) as logs:
        try:
            return _run_rank(job, rank)
        except BaseException as exc:
            logs.failure(exc)
            raise


def _run_rank(job: RankJob, rank: int) -> Summary | None:
    t0 = time.perf_counter()
    restarts = restart_count()
    attempt = job.attempt + restarts
    config = job.config
    if attempt > 0:  # injected faults act in the first attempt only
        config = msgspec.structs.replace(config, faults=FaultsConfig())
    out_dir = Path(job.out_dir)
    if attempt == 0 and rank == 0:
        # A new run: an old journal here is not this run's. (Every other
        # rank writes its journal only once rank 0 has joined the world.)
        shutil.rmtree(out_dir / JOURNAL, ignore_errors=True)
    tokenizer = load_tokenizer(config.tokenizer)
    workload = load_requests(config, job.workload)
    prior = read_prior(out_dir, before=attempt) if attempt > 0 else PriorRun()
    requests = [r for r in workload if r.request_id not in prior.outputs]
    config_fp = config_fingerprint(config)
    model = make_model(config.model, tokenizer)
    sampler = Sampler(config.sampling)
    probe = ResourceProbe(rank)
    probe.start()
    session = _session(config, tokenizer, rank, job.run_id)
    ok, failure = False, None
    c = session.layout.coords(session.rank)
    journal = RankJournal(
        out_dir,
        attempt,
        session.rank,
        fsync_s=config.output.fsync_s,
        fingerprints={r.request_id: request_fingerprint(config_fp, r) for r in requests}
        if session.is_leader and c.pp == 0
        else {},
        outputs=config.output.journal and session.is_leader and c.pp == 0,
        digests=config.output.journal and session.is_last_stage,
    )
    if session.has("leader") and prior.outputs:
        session.leader.carry_poison(carried_poison(prior, workload, config.grammar, tokenizer.name))
    try:
        logger.info("%s on host %s", session.layout.describe(session.rank), socket.gethostname())
        bar, progress = _progress(job, session.rank)
        try:
            if bar is not None:
                bar.start()
            report = run_loop(
                session,
                requests,
                model,
                sampler,
                config.speculative,
                per_step=config.workload.arrivals_per_step,
                progress=progress,
                on_step=probe.on_step,
                on_output=journal.output,
                on_request_end=journal.request_digests,
            )
            probe.end_of_loop(report.steps)
        finally:
            if isinstance(progress, ProgressWriter):
                progress.flush()
            if bar is not None:
                bar.stop()
        data = msgspec.msgpack.encode(report)
        if session.link is not None:
            ranks = tuple(range(session.layout.world_size))
            gathered = session.link.gather(0, data, ranks, step=report.steps)
        else:
            gathered = [data]
        ok = True
    except BaseException as exc:
        failure = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        journal.close()
        session.close(drain=ok, reason=failure)
    probe.after_close(out_dir / "logs")
    if rank != 0:
        return None
    reports = [msgspec.msgpack.decode(g, type=RankReport) for g in gathered]
    outputs, summary = merge(
        reports,
        workload,
        replicated=config.parallel.requests == "replicated",
        wall_s=time.perf_counter() - t0,
        config=msgspec.to_builtins(config),
        prior=prior,
    )
    summary.journal.update(attempt=attempt, restarts=restarts, ran=len(requests))
    write_run(out_dir, outputs, summary, digests_by_request(reports, prior))
    return summary


def entry(job: bytes) -> bytes:
    """The launchers' per-rank entry point (``ENTRY``)."""
    summary = run_rank(msgspec.msgpack.decode(job, type=RankJob))
    return msgspec.msgpack.encode(summary) if summary is not None else b""


def _print_summary(summary: Summary, out_dir: Path) -> None:
    """Rank 0 under the user's own launcher: the table and where the outputs are."""
    from rich.console import Console

    from gramcoord.launch.summary_table import summary_table

    console = Console()
    console.print(summary_table(summary, out_dir))
    console.print(
        f"gramcoord: wrote {out_dir}/outputs.jsonl, summary.json and digests.jsonl; "
        f"logs in {out_dir}/logs",
        markup=False,
        highlight=False,
    )
    for m in summary.determinism.first:
        console.print(
            f"determinism mismatch: {m.what} of request {m.request_id!r} at position "
            f"{m.position} on rank(s) {list(m.ranks)}",
            markup=False,
        )


def main(argv: list[str] | None = None) -> int:
    """``python -m gramcoord.launch.rank_main CONFIG`` under the user's own torchrun."""
    p = argparse.ArgumentParser(prog="gramcoord.launch.rank_main")
    p.add_argument("config")
    p.add_argument("--workload")
    p.add_argument("--out")
    p.add_argument("--run-id", default=os.environ.get("TORCHELASTIC_RUN_ID", "external"))
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"gramcoord: config error: {exc}", file=sys.stderr)
        return 2
    local = os.environ.get("LOCAL_WORLD_SIZE")
    problem = backend_problem(config, int(local) if local and local.isdigit() else None)
    if problem:
        print(f"gramcoord: {problem}", file=sys.stderr)
        return 2
    from gramcoord.coordinator.errors import CoordinatorError
    from gramcoord.rank_worker.errors import DeterminismError
    from gramcoord.sync.errors import TransportError

    job = RankJob(
        config=config,
        workload=args.workload or config.workload.path,
        out_dir=args.out or config.output.dir,
        run_id=args.run_id[:16].replace("/", "_") or "external",
    )
    try:
        summary = run_rank(job)
    except DeterminismError as exc:
        print(f"gramcoord: determinism mismatch: {exc}", file=sys.stderr)
        return 3
    except (CoordinatorError, TransportError) as exc:
        print(f"gramcoord: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # the traceback is in the rank's log
        rank = os.environ.get("RANK", "0")
        print(
            f"gramcoord: rank {rank} failed: {type(exc).__name__}: {exc} "
            f"(traceback in {Path(job.out_dir) / 'logs' / f'rank{rank}.log'})",
            file=sys.stderr,
        )
        return 1
    if summary is None:  # ranks other than 0
        return 0
    _print_summary(summary, Path(job.out_dir))  # what `gramcoord run` prints
    return 3 if summary.determinism.mismatches else 0


if __name__ == "__main__":
    from gramcoord.launch.rank_process import rank_process

    # Leaves with main's status before the interpreter finalizes under
    # gloo's and the store's threads (``rank_process``).
    rank_process(main)
