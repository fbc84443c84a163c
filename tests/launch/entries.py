"""Per-rank entry points for the launcher tests (``entry(job: bytes) -> bytes``).

A plain module, so that spawned workers and ray actors import only this.
``job`` is JSON: ``{"fail_rank": int | null, "hang_rank": int | null}``.
"""

from __future__ import annotations

import datetime
import os
import time

import msgspec

from gramcoord.launch import fork_server


class Job(msgspec.Struct, kw_only=True):
    fail_rank: int | None = None
    hang_rank: int | None = None


class Report(msgspec.Struct, kw_only=True):
    rank: int
    local_rank: int
    world_size: int
    total: int
    pid: int
    # The highest (least favoured) nice value among the rank's threads.
    nice: int = 0


def job(**kwargs) -> bytes:
    return msgspec.json.encode(Job(**kwargs))


def allreduce(raw: bytes) -> bytes:
    """Join a gloo group via ``env://``, all_reduce ``rank + 1``, report the sum."""
    import torch
    import torch.distributed as dist

    spec = msgspec.json.decode(raw, type=Job)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == spec.fail_rank:
        raise ValueError(f"boom on rank {rank}")
    if rank == spec.hang_rank:
        while True:
            time.sleep(1)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
    try:
        t = torch.tensor([rank + 1])
        dist.all_reduce(t)
        total = int(t.item())
    finally:
        dist.destroy_process_group()
    report = Report(
        rank=rank,
        local_rank=int(os.environ["LOCAL_RANK"]),
        world_size=world,
        total=total,
        pid=os.getpid(),
        nice=max(os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")),
    )
    return msgspec.json.encode(report)


def not_bytes(raw: bytes) -> str:
    """An entry that breaks the contract: it returns text."""
    return raw.decode()


def decode(raw: bytes) -> Report:
    return msgspec.json.decode(raw, type=Report)


def descendants(pid: int | None = None) -> set[int]:
    """Live descendants of ``pid`` (default: this process), from /proc.

    Multiprocessing's resource tracker and this process's fork server, helpers
    that live as long as their parent, are left out (the server's children
    are not).
    """
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        # Fields after the command name (which may hold spaces): state, ppid.
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state == "Z" or b"resource_tracker" in cmdline:
            continue
        children.setdefault(int(ppid), []).append(int(name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    # This process's fork server lives as long as it does; its children count.
    found.discard(fork_server.server_pid() if pid is None else None)
    return found


def wait_for_no_descendants(before: set[int], timeout: float = 10.0) -> set[int]:
    """Descendants not in ``before`` that are still alive after ``timeout`` s."""
    end = time.monotonic() + timeout
    while True:
        left = descendants() - before
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.1)


# Set by the launching test in its own process: a forked worker sees the
# value, a spawned one (which imports this module afresh) sees None.
PARENT_MARK: str | None = None


def inherited(raw: bytes) -> bytes:
    """What a warm-forked worker kept from, or was given back instead of, its launcher."""
    import atexit
    import signal
    import sys

    del raw
    return msgspec.json.encode(
        {
            "mark": PARENT_MARK,
            "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
            "stdout_fd": sys.stdout.fileno(),
            "atexit_hooks": atexit._ncallbacks(),
        }
    )
