"""What ``gramcoord run`` says on the console when a run cannot start or fails.

Expected failures are told in a line or two, never a traceback: the whole
traceback of a rank stays in its log (``OUT/logs/rank{R}.log``) and every
rank's report in ``OUT/logs/failures.log``.

- ``backend_problem``: a config whose data plane is NCCL on a machine that
  cannot run it (no CUDA GPUs, too few, torch built without NCCL), found
  before any rank starts (exit status 2);
- ``brief_failure``: the cause of a failed run, the earliest failed rank's
  exception line (exit status 1 or 3);
- ``INTERRUPTED``: the line Ctrl-C ends a run with (exit status 130).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gramcoord.launch.config import ClusterConfig

__all__ = [
    "EXIT_INTERRUPTED",
    "INTERRUPTED",
    "backend_problem",
    "brief_failure",
    "cuda_devices",
    "last_error_line",
    "write_failures",
]

EXIT_INTERRUPTED = 130
INTERRUPTED = "gramcoord: interrupted; ranks stopped, partial logs in {logs}"
# Longest cause printed; the log has the rest.
MAX_LINE = 400


def cuda_devices() -> tuple[bool, int]:
    """(torch has NCCL, CUDA devices visible here)."""
    import torch
    import torch.distributed as dist

    nccl = dist.is_available() and dist.is_nccl_available()
    return nccl, torch.cuda.device_count() if torch.cuda.is_available() else 0


def backend_problem(config: ClusterConfig, local_ranks: int | None = None) -> str | None:
    """Why this machine cannot run ``config``'s NCCL data plane, if it cannot.

    ``local_ranks`` is how many ranks run on this machine (default: the whole
    world over ``distributed.nnodes``); each needs a GPU of its own.
    """
    if config.distributed.backend != "nccl":
        return None
    nnodes = config.distributed.nnodes
    need = local_ranks or -(-config.parallel.world_size // nnodes)
    nccl, have = cuda_devices()
    if nccl and have >= need:
        return None
    why = "this torch is built without NCCL" if not nccl else f"{have} visible here"
    return (
        f"distributed.backend 'nccl' needs CUDA GPUs and a torch built with NCCL: the config "
        f"runs {need} rank(s) on this machine, one GPU each ({why}); on CPU-only machines "
        "use distributed.backend=gloo (e.g. configs/local.yaml)"
    )


def last_error_line(tb: str) -> str:
    """The exception line of a formatted traceback (its class without the module),
    or the first line of a plain explanation."""
    lines = [ln for ln in tb.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    # The final exception's text follows the last indented line (its frame).
    tail = max((i for i, ln in enumerate(lines) if ln.startswith(" ")), default=-1)
    text = lines[tail + 1] if tail + 1 < len(lines) else lines[0].strip()
    head, sep, rest = text.partition(": ")
    if sep and " " not in head:
        text = f"{head.rsplit('.', 1)[-1]}: {rest}"
    return text if len(text) <= MAX_LINE else text[: MAX_LINE - 1] + "…"


def brief_failure(results: Iterable[Any], reason: str) -> str:
    """``reason`` and the cause in one line: the earliest failed rank's error.

    ``results`` are ``RankOutcome``s (or anything with ``rank``, ``ok``,
    ``error_type``, ``traceback``, ``finished_at``). Ranks the launcher
    stopped after another failed count as causes only when no other rank
    failed.
    """
    failed = sorted(
        (r for r in results if not r.ok), key=lambda r: (r.finished_at or float("inf"), r.rank)
    )
    if not failed:
        return reason
    causes = [r for r in failed if r.error_type != "terminated"] or failed
    first = causes[0]
    line = last_error_line(first.traceback) or first.error_type or "no report"
    more = len(failed) - 1
    also = f" ({more} other rank{'s' if more > 1 else ''} stopped)" if more else ""
    return f"{reason}: rank {first.rank}: {line}{also}"


def write_failures(out_dir: Path, text: str) -> Path | None:
    """Keep every rank's report (``format_failures``) in ``OUT/logs/failures.log``."""
    path = out_dir / "logs" / "failures.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    except OSError:
        return None
    return path
