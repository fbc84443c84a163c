"""Re-export of the project's one process helper, ``gramcoord.launch.procs``."""

from gramcoord.launch.procs import (
    ProcGroup,
    ProcResult,
    SpawnError,
    free_port,
    run_procs,
    run_ranks,
)

__all__ = ["ProcGroup", "ProcResult", "SpawnError", "free_port", "run_procs", "run_ranks"]
