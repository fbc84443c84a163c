"""Helpers for the end-to-end launch tests: small workloads, run checks, leak guard.

A plain module (no fixtures) so both ``test_e2e.py`` and ``test_cli_run.py``
can import it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gramcoord.launch import stack_dump
from tests import load
from tests.launch.entries import descendants

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
SHM = Path("/dev/shm")

# Picked from configs/workload.jsonl: fast schemas with short references, a
# json_object, one regex, one choice, two bad specs (one refused at admission,
# one the compiler rejects) and one unconstrained prompt.
SMALL_IDS = (
    "jsonschemabench/Github_trivial/o32735",
    "jsonschemabench/Github_trivial/o27031",
    "gramcoord/json_object/status",
    "jsonschemabench-regex/8f7df4826628d70d",
    "gramcoord/choice/sentiment",
    "bad/compile-error-1",
    "bad/no-kind",
    "gramcoord/plain/greeting",
)
# Expected error code of the records that must fail.
EXPECTED_FAILURES = {
    "bad/compile-error-1": "grammar_invalid",
    "bad/no-kind": "spec_no_kind",
}
# max_tokens overrides (the synthetic model runs a regex to its length).
SMALL_MAX_TOKENS = {"jsonschemabench-regex/8f7df4826628d70d": 24}

# A few short constrained records for the (slow) Hugging Face model.
HF_IDS = (
    "gramcoord/choice/sentiment",
    "gramcoord/choice/capital",
    "jsonschemabench-regex/8f7df4826628d70d",
    "jsonschemabench/Github_trivial/o32735",
)


def fast(load_factor: float | None = None) -> tuple[str, str]:
    """Overrides every multi-process run gets: a short step timeout, and a run
    deadline well inside the tests' 240 s; both 20 s and 150 s on a quiet
    machine, scaled by the load measured now (``tests/load.py``), as the
    tests' own limits are."""
    f = load.factor() if load_factor is None else load_factor
    return (
        f"distributed.step_timeout_s={load.step_timeout(20, f)}",
        f"distributed.run_timeout_s={load.step_timeout(150, f)}",
    )


def write_workload(
    path: Path, ids: Sequence[str], *, max_tokens: dict[str, int] | int | None = None
) -> Path:
    """Copy the records ``ids`` from ``configs/workload.jsonl`` to ``path``, in that order."""
    records = {}
    for line in (CONFIGS / "workload.jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            records[rec["id"]] = rec
    with open(path, "w") as f:
        for rid in ids:
            rec = dict(records[rid])
            if isinstance(max_tokens, int):
                rec["max_tokens"] = max_tokens
            elif max_tokens and rid in max_tokens:
                rec["max_tokens"] = max_tokens[rid]
            f.write(json.dumps(rec) + "\n")
    return path


def workload_specs(path: Path) -> dict[str, Any]:
    return {
        (rec := json.loads(line))["id"]: rec.get("structured_outputs")
        for line in path.read_text().splitlines()
        if line.strip()
    }


def sets(*items: str) -> list[str]:
    """``--set`` arguments for the CLI."""
    out = []
    for item in items:
        out += ["--set", item]
    return out


ABORT = "terminate called"


def aborts(*where: Path | str) -> list[str]:
    """Where a rank aborted at exit ("terminate called ..."): files under the
    given folders (a run's logs: each rank's log, native log and torchrun's
    copies of its stdout/stderr) and given texts that say so."""
    found = []
    for item in where:
        if isinstance(item, str):
            if ABORT in item:
                found.append(item[item.index(ABORT) - 200 :][:600])
            continue
        for path in sorted(item.rglob("*")) if item.is_dir() else []:
            if path.is_file() and ABORT in path.read_text(errors="replace"):
                found.append(str(path))
    return found


def read_outputs(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "outputs.jsonl").read_text().splitlines()]


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def read_digests(run_dir: Path) -> dict[str, list]:
    out = {}
    for line in (run_dir / "digests.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["id"]] = rec["rows"]
    return out


def _is_json_spec(spec: Any) -> bool:
    return isinstance(spec, dict) and ("json" in spec or spec.get("json_object") is True)


def check_run_dir(
    run_dir: Path,
    workload: Path,
    *,
    failures: dict[str, str] | None = None,
    world: int | None = None,
) -> tuple[list[dict], dict]:
    """Assert what every completed run writes; returns (outputs, summary).

    - one output per workload record, in workload order;
    - the records in ``failures`` failed with that error code, the rest are ok;
    - every ok JSON output parses, and the summary's json_valid agrees
      (valid == checked - unverifiable, parsed == checked);
    - no determinism mismatch; digests exist for the constrained requests;
    - one log per rank when ``world`` is given.
    """
    failures = EXPECTED_FAILURES if failures is None else failures
    specs = workload_specs(workload)
    outputs = read_outputs(run_dir)
    summary = read_summary(run_dir)
    assert [o["id"] for o in outputs] == list(specs)
    json_ok = 0
    for o in outputs:
        rid = o["id"]
        if rid in failures:
            assert o["status"] == "failed", o
            assert o["error"]["code"] == failures[rid], o
            assert o["finish_reason"] == "error" and o["token_ids"] == []
            continue
        assert o["status"] == "ok", o
        assert o["error"] is None
        assert o["token_ids"], o
        if _is_json_spec(specs[rid]):
            json_ok += 1
            json.loads(o["text"])  # every ok JSON output parses
    assert summary["requests"]["total"] == len(outputs)
    assert summary["requests"]["failed"] == len(failures)
    assert summary["requests"]["by_error"] == dict(Counter(failures.values()))
    valid = summary["json_valid"]
    assert valid["checked"] == json_ok
    assert valid["parsed"] == valid["checked"]
    assert valid["valid"] == valid["checked"] - valid["unverifiable"]
    assert summary["tokens"]["generated"] == sum(len(o["token_ids"]) for o in outputs)
    det = summary["determinism"]
    assert det["mismatches"] == 0 and det["first"] == [], det
    digests = read_digests(run_dir)
    constrained_ok = {
        o["id"] for o in outputs if o["status"] == "ok" and specs[o["id"]] is not None
    }
    assert constrained_ok <= set(digests), constrained_ok - set(digests)
    # An unconstrained request's rows are never masked.
    assert not {rid for rid, spec in specs.items() if spec is None} & set(digests)
    if world is not None:
        for r in range(world):
            assert (run_dir / "logs" / f"rank{r}.log").is_file(), r
    return outputs, summary


def squash(text: str) -> str:
    """Console text with rich's line wrapping undone."""
    return " ".join(text.split())


# -- processes and /dev/shm ------------------------------------------------------


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def run_cmd(
    argv: Sequence[str], *, timeout: float, cwd: Path | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``subprocess.run`` in its own session: on a timeout the whole group is killed.

    After a normal exit nothing is killed, so that a leak guard can see what
    the command left behind.
    """
    proc = subprocess.Popen(
        list(argv),
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        where = _where_ranks_wait(proc.pid, list(argv))
        _kill_group(proc.pid)
        proc.communicate()
        raise TimeoutError(f"{' '.join(map(str, argv))} ran past {timeout:g}s{where}") from exc
    except BaseException:
        _kill_group(proc.pid)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _where_ranks_wait(pgid: int, argv: list[str]) -> str:
    """Ask every rank of a run past its deadline where it waits (their
    ``logs/rank{R}.stacks``), so a slow machine can be told from a hang."""
    if "--out" not in argv:
        return ""
    logs = Path(argv[argv.index("--out") + 1]) / "logs"
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, stack_dump.DUMP_SIGNAL)
    found = stack_dump.collect(sorted(logs.glob("rank*.stacks")))
    if not found:
        return "; no rank answered the stack dump"
    lines = [f"\n  {p.stem} {stack_dump.waiting_in(text)}" for p, text in sorted(found.items())]
    return "; where each rank waits:" + "".join(lines)


def _start_time(pid: int) -> int | None:
    """Start time of a live (not zombie) process, in clock ticks; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _shm_names_of(pid: int) -> set[str]:
    """``/dev/shm`` names that ``pid`` maps or holds open now."""
    names = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                i = line.find("/dev/shm/")
                if i >= 0:
                    names.add(line[i + 9 :].split(" (deleted)")[0].strip())
    except OSError:
        return names
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return names
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/shm/"):
            names.add(target[9:])
    return names


def _holders(names: set[str]) -> dict[str, set[int]]:
    """Live processes that map or hold open ``/dev/shm/<name>``, per name."""
    held: dict[str, set[int]] = {n: set() for n in names}
    if not names:
        return held
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            for name in _shm_names_of(int(pid)) & names:
                held[name].add(int(pid))
    return held


def _live_semaphores() -> set[str]:
    """``/dev/shm`` names of the multiprocessing semaphores alive in this process."""
    from multiprocessing.synchronize import SemLock

    out = set()
    for obj in gc.get_objects():
        if issubclass(type(obj), SemLock):
            name = getattr(obj._semlock, "name", None)
            if name:
                out.add("sem." + name.lstrip("/"))
    return out


_SEGMENT = re.compile(r"^gramcoord-.*-(\d+)-[0-9a-f]+$")


class LeakGuard:
    """Snapshot this process's descendants and ``/dev/shm`` before a test; check after.

    Other sessions share this machine and its ``/dev/shm``, so a new entry
    counts as this test's leak only if it is attributable to it:

    - a ``gramcoord-*`` segment whose creator pid (in its name) was this
      process or one of its descendants during the test;
    - any name this process or a descendant was seen mapping or holding open
      (a sampler thread records descendant pids and their ``/dev/shm`` names);
    - a ``sem.*`` name of a multiprocessing semaphore still alive here;
    - any other new name (not ``sem.*``: glibc maps a semaphore under a
      temporary name, so who holds one cannot be seen) that no live process
      other than ours holds.
    """

    def __init__(self) -> None:
        self.me = os.getpid()
        self.procs_before = descendants()
        self.shm_before = set(os.listdir(SHM))
        # pid -> start time of every new descendant seen during the test.
        self.seen: dict[int, int] = {}
        self.seen_shm: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            now = descendants() - self.procs_before
            for pid in now:
                if pid not in self.seen:
                    start = _start_time(pid)
                    if start is not None:
                        self.seen[pid] = start
            for pid in now | {self.me}:
                self.seen_shm |= _shm_names_of(pid)

    def new_processes(self) -> dict[int, str]:
        """New descendants, and processes seen during the test that are still
        alive though no longer descendants (orphans, reparented to init)."""
        pids = descendants() - self.procs_before
        pids |= {pid for pid, start in self.seen.items() if _start_time(pid) == start}
        out = {}
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out[pid] = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
            except OSError:
                continue
        return out

    def leaked_shm(self) -> dict[str, str]:
        new = set(os.listdir(SHM)) - self.shm_before
        ours = set(self.seen) | descendants() | {self.me}
        holders = _holders(new)
        semaphores = _live_semaphores() if any(n.startswith("sem.") for n in new) else set()
        leaked = {}
        for name in sorted(new):
            m = _SEGMENT.match(name)
            by = holders[name]
            if m and int(m.group(1)) in ours:
                leaked[name] = f"created by our pid {m.group(1)}, held by {sorted(by)}"
            elif name in self.seen_shm:
                leaked[name] = f"used by our processes, held by {sorted(by)}"
            elif name in semaphores:
                leaked[name] = "a semaphore still alive in this process"
            elif not m and not name.startswith("sem.") and by <= ours:
                leaked[name] = f"held by {sorted(by)}"
        return leaked

    def check(self, timeout: float = 20.0) -> None:
        """Wait up to ``timeout`` s for everything new to go, then assert it went.

        Processes still left are killed (after being reported), so that one
        failure does not spill into the next test.
        """
        self._stop.set()
        self._thread.join()
        end = time.monotonic() + timeout
        while True:
            gc.collect()
            procs, shm = self.new_processes(), self.leaked_shm()
            if (not procs and not shm) or time.monotonic() > end:
                break
            time.sleep(0.25)
        for pid in procs:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        assert not procs, f"processes left behind: {procs}"
        assert not shm, f"/dev/shm entries left behind: {shm}"


def leak_guarded(monkeypatch):
    """The e2e tests' autouse fixture body: one line per console message
    (rich wraps at $COLUMNS), and a ``LeakGuard`` checked after the test.

    Use as ``leak_guard = pytest.fixture(autouse=True)(leak_guarded)``.
    """
    monkeypatch.setenv("COLUMNS", "1000")
    guard = LeakGuard()
    yield guard
    guard.check()
