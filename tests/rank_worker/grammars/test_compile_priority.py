"""``grammar.compile_nice``: compile threads, and the threads a compile starts, run at a
lower CPU priority than the step loop (Linux), so a compile storm cannot starve the step."""

from __future__ import annotations

import os
import sys
import threading

import msgspec
import pytest

from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.grammars.compile_service import CompileService
from gramcoord.rank_worker.grammars.spec import validate_spec

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="nice is per thread on Linux")

CFG = GrammarConfig()


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _priorities(config: GrammarConfig) -> tuple[int, int]:
    """(the compiling thread's nice, the nice of a thread that compile starts)."""
    seen: dict[str, int] = {}

    def compile_fn(spec):
        seen["worker"] = _nice()
        # xgrammar starts its own threads inside a compile: they inherit.
        inner = threading.Thread(target=lambda: seen.__setitem__("inner", _nice()))
        inner.start()
        inner.join()
        return object()

    service = CompileService(config, compile_fn)
    try:
        job, _ = service.submit(validate_spec({"regex": "ab+"}, CFG))
        assert service.wait(job, 30.0) and job.error is None
    finally:
        service.close()
    return seen["worker"], seen["inner"]


def test_compile_threads_run_at_the_configured_lower_priority():
    base = _nice()
    if base + 3 > 19:
        pytest.skip("this process already runs at the lowest priority")
    assert _priorities(GrammarConfig(compile_nice=3)) == (base + 3, base + 3)
    assert _nice() == base  # the caller (the step loop) keeps its priority


def test_default_keeps_the_process_priority():
    base = _nice()
    assert _priorities(GrammarConfig()) == (base, base)


def test_sync_mode_never_lowers_the_step_loops_own_thread():
    base = _nice()
    assert _priorities(GrammarConfig(compile_mode="sync", compile_nice=5)) == (base, base)


def test_out_of_range_is_a_config_error():
    with pytest.raises(msgspec.ValidationError, match="compile_nice"):
        msgspec.convert({"compile_nice": 20}, GrammarConfig)
