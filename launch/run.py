"""``gramcoord run`` and ``gramcoord verify``: start the cluster, report, compare.

``run`` starts every rank with the configured launcher; they run the step
loop and rank 0 writes ``outputs.jsonl``, ``digests.jsonl`` and
``summary.json`` into the output directory. ``verify`` runs the same
workload twice, through the configured topology and through the one-process
reference (``launcher: inline``), and compares outputs per request and mask
digests per request and position.

Exit status: 0 the run completed (whatever the per-request failures), 1 an
infrastructure failure (a lost peer, a timeout, a rank that died), 2 a bad
config or workload, 3 a determinism mismatch.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from pathlib import Path

import msgspec
from rich.console import Console

from gramcoord.engine.hf_checks import check_hf_model
from gramcoord.launch.config import ClusterConfig
from gramcoord.launch.failures import (
    EXIT_INTERRUPTED,
    INTERRUPTED,
    backend_problem,
    brief_failure,
    write_failures,
)
from gramcoord.launch.journal import attempts
from gramcoord.launch.launchers import RankOutcome, launch_inline, launch_torchrun
from gramcoord.launch.procs import format_failures, patched_environ
from gramcoord.launch.progress import watch_progress
from gramcoord.launch.rank_main import ENTRY, RankJob
from gramcoord.launch.resources import RUN_ID_ENV, collect
from gramcoord.launch.summary import Determinism, Summary, write_summary
from gramcoord.launch.summary_table import summary_table
from gramcoord.rank_worker.errors import DeterminismError

EXIT_OK, EXIT_INFRA, EXIT_CONFIG, EXIT_DETERMINISM = 0, 1, 2, 3
# Ranks report their exception by class name (RankOutcome.error_type).
_DETERMINISM_ERROR = DeterminismError.__name__


class RunResult(msgspec.Struct, kw_only=True):
    exit_code: int
    summary: Summary | None = None
    out_dir: str = ""
    error: str = ""


def check_inputs(config: ClusterConfig, workload: str) -> str | None:
    """What is wrong with the inputs before any process starts, if anything."""
    if not Path(workload).is_file():
        return f"workload {workload} not found"
    mix = config.workload.mix_path
    if mix and not Path(mix).is_file():
        return f"workload.mix_path {mix} not found"
    if config.model.kind == "hf" and not Path(config.model.path or "").is_dir():
        return f"model.path {config.model.path} is not a directory"
    if problem := check_hf_model(config.model, config.tokenizer):
        return problem
    if config.launcher == "external":
        return (
            "launcher 'external' means your own launcher starts the ranks: run "
            "`torchrun --nproc-per-node N -m gramcoord.launch.rank_main CONFIG`"
        )
    return backend_problem(config)


def launch(
    config: ClusterConfig, workload: str, out_dir: Path, *, progress: bool, attempt: int = 0
) -> RunResult:
    """Start every rank and wait for them; never raises for a failed rank.

    With ``progress`` the scheduler ranks report their counts to this process,
    which draws the bar on stderr when that is a terminal (``progress.py``).
    ``KeyboardInterrupt`` propagates once every rank is stopped.
    """
    job = RankJob(
        config=config,
        workload=workload,
        out_dir=str(out_dir),
        run_id=secrets.token_hex(4),
        progress=False,
        attempt=attempt,
    )
    # Every rank process inherits it, so leftovers can be found (resources.py).
    with (
        patched_environ({RUN_ID_ENV: job.run_id}),
        watch_progress(parent=out_dir) if progress else contextlib.nullcontext("") as progress_dir,
    ):
        outcomes = _start(config, msgspec.structs.replace(job, progress_dir=progress_dir))
    result = _result(outcomes, out_dir)
    if result.summary is not None:
        result.summary.resources = collect(out_dir, job.run_id, config.parallel.world_size)
        write_summary(out_dir, result.summary)
    return result


def _start(config: ClusterConfig, job: RankJob) -> list[RankOutcome]:
    out_dir = Path(job.out_dir)
    data = msgspec.msgpack.encode(job)
    world = config.parallel.world_size
    deadline = config.distributed.run_timeout_s
    if config.launcher == "inline":
        outcomes = launch_inline(ENTRY, data)
    elif config.launcher == "torchrun":
        outcomes = launch_torchrun(
            ENTRY,
            data,
            nproc=world,
            deadline_s=deadline,
            master_addr=config.distributed.master_addr,
            master_port=config.distributed.master_port,
            log_dir=str(out_dir / "logs" / "torchrun"),
            max_restarts=config.distributed.max_restarts,
        )
    else:
        from gramcoord.launch.ray_launcher import launch_ray

        outcomes = launch_ray(
            ENTRY,
            data,
            nproc=world,
            deadline_s=deadline,
            address=config.distributed.ray_address,
            strategy=config.distributed.ray_strategy,
        )
    return outcomes


def _result(outcomes: list[RankOutcome], out_dir: Path) -> RunResult:
    failed = [o for o in outcomes if not o.ok]
    if failed or not outcomes:
        code = (
            EXIT_DETERMINISM
            if any(o.error_type == _DETERMINISM_ERROR for o in failed)
            else EXIT_INFRA
        )
        # The cause on the console, every rank's traceback in the logs.
        kept = write_failures(out_dir, format_failures(outcomes, "the run failed"))
        error = brief_failure(outcomes, "gramcoord: the run failed")
        if kept is not None:
            error += f"\nfull tracebacks: {kept} and the rank logs beside it"
        return RunResult(exit_code=code, out_dir=str(out_dir), error=error)
    rank0 = next(o for o in outcomes if o.rank == 0)
    summary = msgspec.msgpack.decode(rank0.value, type=Summary)
    code = EXIT_DETERMINISM if summary.determinism.mismatches else EXIT_OK
    return RunResult(exit_code=code, summary=summary, out_dir=str(out_dir))


def resume_attempt(config: ClusterConfig, workload: str, out_dir: Path) -> tuple[int, str | None]:
    """The attempt a ``--resume`` of ``out_dir`` starts at, or why it cannot resume."""
    from gramcoord.launch.journal import config_fingerprint, read_prior, resume_problem
    from gramcoord.launch.rank_main import load_requests

    if not config.output.journal:
        return 0, "--resume reads the journal, and output.journal is false"
    if not attempts(out_dir):
        return 0, f"nothing to resume: {out_dir} holds no journal (run it without --resume)"
    prior = read_prior(out_dir)
    problem = resume_problem(prior, load_requests(config, workload), config_fingerprint(config))
    return prior.attempts, problem


def main_run(
    config: ClusterConfig,
    workload: str,
    out_dir: Path,
    console: Console,
    *,
    resume: bool = False,
) -> int:
    problem = check_inputs(config, workload)
    attempt = 0
    if problem is None and resume:
        attempt, problem = resume_attempt(config, workload, out_dir)
    if problem:
        console.print(f"gramcoord: {problem}", markup=False, highlight=False)
        return EXIT_CONFIG
    try:
        result = launch(config, workload, out_dir, progress=True, attempt=attempt)
    except KeyboardInterrupt:  # every rank is stopped by now
        console.print(INTERRUPTED.format(logs=out_dir / "logs"), markup=False, highlight=False)
        return EXIT_INTERRUPTED
    if result.summary is not None:
        console.print(summary_table(result.summary, out_dir))
    if result.error:
        console.print(result.error, markup=False, highlight=False)
    if result.summary is not None and result.summary.determinism.mismatches:
        for m in result.summary.determinism.first:
            console.print(
                f"determinism mismatch: {m.what} of request {m.request_id!r} at position "
                f"{m.position} on rank(s) {list(m.ranks)}",
                markup=False,
            )
    return result.exit_code


# -- verify -------------------------------------------------------------------


def reference_config(config: ClusterConfig) -> ClusterConfig:
    """The same run on one process (the reference topology)."""
    from gramcoord.coordinator.config import ParallelConfig

    return msgspec.structs.replace(
        config,
        launcher="inline",
        parallel=ParallelConfig(),
        faults=msgspec.structs.replace(config.faults, flip_mask_bit=None),
    )


def _load(out_dir: Path) -> tuple[dict, dict]:
    outputs = {}
    with open(out_dir / "outputs.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            outputs[rec["id"]] = rec
    digests = {}
    with open(out_dir / "digests.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            digests[rec["id"]] = {pos: d for pos, d in rec["rows"]}
    return outputs, digests


# Failures that depend on load (a compile deadline), not on the workload.
LOAD_DEPENDENT = ("grammar_timeout", "grammar_pool_saturated", "grammar_stage_timeout")


def compare_runs(topology: Path, reference: Path) -> tuple[list[str], int, int]:
    """Differences between two run directories; plus requests and rows compared
    (requests left out for a compile deadline do not count)."""
    out_a, dig_a = _load(topology)
    out_b, dig_b = _load(reference)
    diffs: list[str] = []
    rows = 0
    skipped = 0
    for rid, b in out_b.items():
        a = out_a.get(rid)
        if a is None:
            diffs.append(f"request {rid!r}: missing from the topology run")
            continue
        codes = {(x.get("error") or {}).get("code") for x in (a, b)}
        if codes & set(LOAD_DEPENDENT):
            skipped += 1
            continue
        if a["status"] != b["status"] or codes != {(b.get("error") or {}).get("code")}:
            diffs.append(
                f"request {rid!r}: status {a['status']}/{codes} vs reference {b['status']}"
            )
            continue
        if a["token_ids"] != b["token_ids"]:
            ta, tb = a["token_ids"], b["token_ids"]
            i = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
            diffs.append(f"request {rid!r}: token_ids differ first at position {i}")
        da, db = dig_a.get(rid, {}), dig_b.get(rid, {})
        for pos in sorted(set(da) & set(db)):
            rows += 1
            if da[pos] != db[pos]:
                diffs.append(f"request {rid!r}: mask digest differs at position {pos}")
                break
    for rid in out_a.keys() - out_b.keys():
        diffs.append(f"request {rid!r}: missing from the reference run")
    return diffs, len(out_b) - skipped, rows


def main_verify(config: ClusterConfig, workload: str, out_dir: Path, console: Console) -> int:
    problem = check_inputs(config, workload)
    if problem:
        console.print(f"gramcoord: {problem}")
        return EXIT_CONFIG
    topo = launch(config, workload, out_dir / "topology", progress=True)
    if topo.exit_code not in (EXIT_OK, EXIT_DETERMINISM) or topo.summary is None:
        console.print(topo.error, markup=False, highlight=False)
        return topo.exit_code
    ref = launch(reference_config(config), workload, out_dir / "reference", progress=True)
    if ref.exit_code != EXIT_OK:
        console.print(ref.error, markup=False, highlight=False)
        return ref.exit_code
    diffs, n, rows = compare_runs(out_dir / "topology", out_dir / "reference")
    if topo.exit_code == EXIT_DETERMINISM:
        diffs.insert(0, _own_disagreement(topo.summary.determinism))
    if diffs:
        console.print(f"verify: {len(diffs)} difference(s); first: {diffs[0]}", markup=False)
        return EXIT_DETERMINISM
    if n == 0:
        verdict = "nothing compared (every request was left out for a compile deadline)"
    elif rows == 0:
        verdict = f"identical outputs: {n} requests; no mask rows to compare"
    else:
        verdict = f"identical to the one-process reference: {n} requests, {rows} mask rows"
    console.print(f"verify: {verdict} ({out_dir})", markup=False)
    return EXIT_OK


def _own_disagreement(det: Determinism) -> str:
    """The first difference the topology run found among its own ranks."""
    first = det.first
    if not first:
        return "the topology run's own ranks disagree (no difference recorded)"
    m = first[0]
    where = f"at position {m.position}" if m.position >= 0 else "in its output"
    return (
        f"the topology run's own ranks disagree: {m.what} of request {m.request_id!r} "
        f"{where} on rank(s) {list(m.ranks)}"
    )
