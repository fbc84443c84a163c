"""A process that exits while real xgrammar compiles still run keeps its status.

Each case runs a host program in a subprocess: it starts three slow compiles
(the real xgrammar compile of a 6,000-value enum), waits until all three are
inside native code, and exits one way or another. A finalizer in its
``__main__`` sleeps, so finalization outlasts the compiles: without
``native_exit`` they return into a finalizing interpreter, the daemon thread
is ended with ``pthread_exit`` inside a ``noexcept`` destructor, and the
process aborts ("terminate called without an active exception", SIGABRT).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.load import scaled

ROOT = Path(__file__).resolve().parents[3]

# Finalization outlasts any compile here: the abort comes when a compile
# returns during it; with the fix the process leaves before it begins.
SLOW_FINALIZER = """
import time as _time

class _SlowFinalization:
    def __init__(self, seconds):
        self.seconds, self.sleep = seconds, _time.sleep

    def __del__(self):
        print("finalized", flush=True)
        self.sleep(self.seconds)

_keep = _SlowFinalization(30.0)
"""

HOST = (
    SLOW_FINALIZER
    + """
import sys, time
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.grammars import native_exit
from gramcoord.rank_worker.grammars.manager import GrammarManager
from tests.conftest import make_tiny_tokenizer

mode, out_path = sys.argv[1], sys.argv[2]
config = GrammarConfig(num_compile_workers=3, compile_timeout_s=0.05)
tokenizer = make_tiny_tokenizer()
compile_fn = None
if mode == "host_compiler":  # a host engine's own compiler, as vLLM's backend passes it
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(tokenizer.info, max_threads=1)
    compile_fn = lambda spec: compiler.compile_json_schema(spec.text)
manager = GrammarManager(config, tokenizer, compile_fn=compile_fn)
for i in range(3):
    enum = [f"v{i}-{j}-padding" for j in range(6000)]
    assert manager.add(f"r{i}", {"json": {"enum": enum}}).status == "pending"
deadline = time.monotonic() + 120
while native_exit.in_flight() < 3:
    assert time.monotonic() < deadline, "the compiles never started"
    time.sleep(0.005)
if mode == "idle":  # nothing in flight at exit: finalization as usual
    _keep.seconds = 0.0
    while native_exit.in_flight():
        time.sleep(0.01)
out = open(out_path, "w")  # never closed: finalization would flush it
out.write("complete\\n")
print("results written")  # block-buffered into the pipe
if mode == "sys_exit":
    sys.exit(3)
if mode == "raise":
    raise RuntimeError("unhandled in the host")
if mode == "caught_exit":
    try:
        sys.exit(9)
    except SystemExit as exc:
        assert exc.code == 9
if mode == "exiting":
    raise SystemExit(native_exit.exiting(5))
if mode == "interrupt":
    raise KeyboardInterrupt
"""
)


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _no_abort(proc: subprocess.CompletedProcess[str]) -> None:
    assert "terminate called" not in proc.stderr, proc.stderr
    assert "Aborted" not in proc.stderr, proc.stderr
    assert proc.returncode != -6, proc.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("mode", "status"),
    [
        ("return", 0),
        ("host_compiler", 0),
        ("sys_exit", 3),
        ("raise", 1),
        ("caught_exit", 0),
        ("exiting", 5),
        ("interrupt", -signal.SIGINT),  # as CPython: it dies of SIGINT
    ],
)
def test_exit_with_compiles_in_flight_keeps_the_status(tmp_path, mode, status):
    out = tmp_path / "out.txt"
    proc = _run(["-c", HOST, mode, str(out)], timeout=scaled(100))
    _no_abort(proc)
    assert proc.returncode == status, proc.stderr
    assert proc.stdout == "results written\n"  # flushed; left before finalization
    assert out.read_text() == "complete\n"
    if mode == "raise":
        assert "RuntimeError: unhandled in the host" in proc.stderr


@pytest.mark.timeout(120)
def test_exit_with_nothing_in_flight_finalizes_as_usual(tmp_path):
    out = tmp_path / "out.txt"
    proc = _run(["-c", HOST, "idle", str(out)], timeout=scaled(100))
    _no_abort(proc)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "results written\nfinalized\n"
    assert out.read_text() == "complete\n"


CLI = (
    SLOW_FINALIZER
    + """
import runpy, sys
sys.argv = ["gramcoord", *sys.argv[1:]]
runpy.run_module("gramcoord.launch.cli", run_name="__main__", alter_sys=True)
"""
)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_check_exits_0_with_a_stuck_compile(tmp_path):
    # 10,000 values compile for seconds with the Qwen vocabulary, far past
    # the 0.3 s deadline: the check is over while that compile still runs.
    slow = {"enum": [f"value-{i}-padding" for i in range(10_000)]}
    records = [
        {"id": "slow", "schema": slow},
        {"id": "quick", "kind": "regex", "regex": "[0-9]{3}"},
        {"id": "bad", "kind": "regex", "regex": "(unclosed"},
    ]
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "check.jsonl"
    args = [str(workload), "--out", str(out), "--set", "grammar.compile_timeout_s=0.3"]
    proc = _run(["-c", CLI, "check", *args], timeout=scaled(170))
    _no_abort(proc)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(ln["id"], ln["code"]) for ln in lines] == [
        ("slow", "grammar_timeout"),
        ("quick", None),
        ("bad", "grammar_invalid"),
    ]
    assert "finalized" not in proc.stdout  # it left with the compile in flight


def test_a_forked_child_inherits_no_calls():
    from gramcoord.rank_worker.grammars import native_exit

    # Compiles another test of this worker left running on a pool thread are
    # counted too (every pool compile is a native call): this test adds none.
    before = native_exit.in_flight()
    script = textwrap.dedent(
        """
        import os
        from gramcoord.rank_worker.grammars import native_exit
        with native_exit.native_call():
            pid = os.fork()
            if pid == 0:
                os._exit(10 + native_exit.in_flight())
            print(os.waitpid(pid, 0)[1] >> 8, native_exit.in_flight())
        """
    )
    proc = _run(["-c", script], timeout=scaled(60))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["10", "1"]
    assert native_exit.in_flight() == before
