"""The roll call that names the ranks lost when a control call fails.

When a collective or a point-to-point call times out, the survivors each
write "alive" under one key prefix of the rendezvous store and look for the
others' keys for a short while. Whoever is missing at the end is reported
lost (``PeerLostError``), all within the step timeout.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist


def roll_call(
    store: dist.Store | None,
    prefix: str,
    rank: int,
    ranks: tuple[int, ...],
    *,
    timeout_s: float,
) -> tuple[tuple[int, ...], str]:
    """Ask the store who of ``ranks`` is still alive, within ``timeout_s``.

    A store call can block without bound when the store's host is cut off
    (a network partition): its own timeout does not cover ``check``. So the
    calls run on a daemon thread, and a roll call that does not finish in
    time counts as "the store host is unreachable".

    Returns
    -------
    lost, how:
        The ranks that did not answer, and how that was found out.
    """
    if store is None:
        return (), "no store for a roll call"
    box: dict[str, object] = {}

    def call() -> None:
        try:
            store.set(f"{prefix}{rank}", "1")
            missing = {r for r in ranks if r != rank}
            deadline = time.monotonic() + timeout_s
            while missing and time.monotonic() < deadline:
                missing = {r for r in missing if not store.check([f"{prefix}{r}"])}
                if missing:
                    time.sleep(0.02)
            box["missing"] = missing
        except Exception as exc:
            box["error"] = exc

    worker = threading.Thread(target=call, name="roll-call", daemon=True)
    worker.start()
    worker.join(timeout_s + 0.5)
    if "missing" in box:
        return tuple(sorted(box["missing"])), f"no answer to the roll call within {timeout_s:.1f}s"
    what = type(box["error"]).__name__ if "error" in box else "no answer in time"
    if rank != 0:  # the store lives with rank 0 (Runtime.start, and torchrun's agent)
        return (0,), f"the store host (rank 0) is unreachable ({what})"
    return (), f"roll call failed ({what}; the store host may be lost)"
