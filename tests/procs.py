"""The project's one process helper, ``gramcoord.launch.procs``, as tests use it, and the
torchrun command line the multi-rank host tests share.

``run_procs`` and ``run_ranks`` here take the deadline a quiet machine needs
and stretch it by the measured load (``tests.load``): the deadline guards
against a hang, so a busy machine makes a test slower, never red. A test of
the deadline itself imports them from ``gramcoord.launch.procs``.
"""

import sys
from pathlib import Path
from typing import Any

from gramcoord.launch import procs as _procs
from gramcoord.launch.ports import free_port
from gramcoord.launch.procs import ProcGroup, ProcResult, SpawnError
from tests.load import scaled

__all__ = [
    "ProcGroup",
    "ProcResult",
    "SpawnError",
    "free_port",
    "run_procs",
    "run_ranks",
    "torchrun_command",
]


def run_procs(fn: Any, nprocs: int, *, timeout: float = 120.0, **kw: Any) -> list[ProcResult]:
    """``gramcoord.launch.procs.run_procs`` with ``timeout`` scaled by the load."""
    return _procs.run_procs(fn, nprocs, timeout=scaled(timeout), **kw)


def run_ranks(
    fn: Any, world_size: int, *, timeout: float = 120.0, init_timeout_s: float = 30.0, **kw: Any
) -> list[ProcResult]:
    """``gramcoord.launch.procs.run_ranks`` with both deadlines scaled by the load."""
    return _procs.run_ranks(
        fn, world_size, timeout=scaled(timeout), init_timeout_s=scaled(init_timeout_s), **kw
    )


def torchrun_command(
    script: str | Path, *args: str, nproc: int = 2, log_dir: Path, tee: bool = False
) -> list[str]:
    """``torchrun`` on 127.0.0.1 with a free port; ``tee`` also writes each rank's
    stdout and stderr to its own file under ``log_dir``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    cmd += ["--log-dir", str(log_dir)]
    if tee:
        cmd += ["--tee", "3"]
    return [*cmd, str(script), *args]
