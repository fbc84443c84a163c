"""Re-export of the project's one process helper, ``gramcoord.launch.procs``, and the
torchrun command line the multi-rank host tests share."""

import sys
from pathlib import Path

from gramcoord.launch.procs import (
    ProcGroup,
    ProcResult,
    SpawnError,
    free_port,
    run_procs,
    run_ranks,
)

__all__ = [
    "ProcGroup",
    "ProcResult",
    "SpawnError",
    "free_port",
    "run_procs",
    "run_ranks",
    "torchrun_command",
]


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
