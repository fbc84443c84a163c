"""Process entry points for the transport's multi-process tests.

They live in a plain module (not a test module) so that spawned children
import only this, ``numpy`` and ``sync``. Every entry point reports through
a queue as a tuple ``(name, outcome, payload, dropped, mode)``; ``outcome``
is ``"ok"`` or the exception's class name, so the parent can assert on it.
"""

from __future__ import annotations

import glob
import hashlib
import os
import random
import signal
import tempfile
import time
import traceback

import numpy as np

from gramcoord.sync import (
    BitmaskChannel,
    BitmaskReceiver,
    BitmaskRing,
    ChannelClosed,
    TransportConfig,
)
from gramcoord.sync.janitor import PREFIX

VOCAB = 1000  # 32 words per row: small enough for thousands of steps on 2 cores
MAX_ROWS = 12
SHM_DIR = "/dev/shm"


def shm_names(run_id: str) -> list[str]:
    """Segments of this run still in /dev/shm."""
    if not os.path.isdir(SHM_DIR):
        return []
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}-{run_id}-"))


def ipc_dirs(run_id: str) -> list[str]:
    """Private ipc directories of this run still on disk."""
    pattern = f"{PREFIX}-{run_id}-*"
    found = glob.glob(os.path.join(tempfile.gettempdir(), pattern)) + glob.glob(f"/tmp/{pattern}")
    return sorted(set(found))


def wait_until(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` until true; fail after ``timeout`` s (a hang bound)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def mask_for(step: int, max_rows: int = MAX_ROWS, vocab: int = VOCAB):
    """The deterministic rows, request ids and drafts the writer sends at ``step``."""
    rng = np.random.default_rng(step)
    rows = int(rng.integers(0, max_rows + 1))
    width = -(-vocab // 32)
    info = np.iinfo(np.int32)
    array = rng.integers(info.min, info.max, size=(rows, width), dtype=np.int32, endpoint=True)
    n = int(rng.integers(0, 5))
    order = tuple(f"req-{step}-{i}" for i in range(n))
    drafts = tuple(int(d) for d in rng.integers(0, 3, size=n))
    return array, order, drafts


def digest(step: int, array: np.ndarray, order, drafts) -> bytes:
    """What both ends compare: the step, the rows' bytes and the metadata."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{step}|{array.shape}|{order}|{drafts}|".encode())
    h.update(np.ascontiguousarray(array).tobytes())
    return h.digest()


def expected_digests(steps) -> list[bytes]:
    return [digest(s, *mask_for(s)) for s in steps]


def reader_main(
    handle,
    name: str,
    steps: list[int],
    out,
    *,
    hostname: str | None = None,
    recheck_seed: int | None = None,
    die_after: int | None = None,
    hold_after: int | None = None,
    stop=None,
    timeout: float | None = None,
    until_closed: bool = False,
) -> None:
    """Receive ``steps``, digest each one, release it; report the digests.

    ``recheck_seed``: before each release, pause a little (random) and digest
    the view again; a changed digest means the writer overwrote a held slot.
    ``die_after``: SIGKILL ourselves after receiving that many steps, holding
    the last one. ``hold_after``: after that many steps, hold the last one
    without releasing until ``stop`` is set. ``until_closed``: afterwards,
    keep receiving until the writer closes the channel, so that every frame
    it sent has been read.
    """
    rx = None
    digests: list[bytes] = []
    try:
        rx = BitmaskReceiver.connect(handle, name, vocab_size=handle.vocab_size, hostname=hostname)
        pause = random.Random(recheck_seed)
        for i, step in enumerate(steps):
            view, order, drafts = rx.receive(step, timeout=timeout)
            first = digest(step, view, order, drafts)
            digests.append(first)
            if die_after is not None and i + 1 == die_after:
                out.put((name, "ready-to-die", len(digests), rx.dropped, rx.mode))
                os.kill(os.getpid(), signal.SIGKILL)
            if hold_after is not None and i + 1 == hold_after:
                out.put((name, "holding", step, rx.dropped, rx.mode))
                stop.wait(60)
                break
            if recheck_seed is not None:
                if pause.random() < 0.2:
                    time.sleep(pause.random() * 2e-3)
                if digest(step, view, order, drafts) != first:
                    raise AssertionError(f"step {step} changed while {name} held it")
            rx.release(step)
        if until_closed:
            try:
                rx.receive(steps[-1] + 1 if steps else 0)
            except ChannelClosed:
                pass
            else:
                raise AssertionError(f"{name} received a step beyond {steps[-1]}")
        out.put((name, "ok", digests, rx.dropped, rx.mode))
    except BaseException as exc:
        detail = f"{exc} (after {len(digests)} steps)\n{traceback.format_exc()}"
        out.put((name, type(exc).__name__, detail, None, None))
    finally:
        if rx is not None:
            rx.close()


def writer_main(
    readers: list[str], run_id: str, out, go, *, steps: int, config: TransportConfig
) -> None:
    """Create a channel, report its handle, publish ``steps`` steps, then wait to be killed."""
    channel = BitmaskChannel(
        readers=readers, vocab_size=VOCAB, max_rows=MAX_ROWS, config=config, run_id=run_id
    )
    out.put(("writer", "handle", channel.handle, None, None))
    channel.accept()
    for step in range(steps):
        channel.publish(step, *mask_for(step))
    channel.drain()
    out.put(("writer", "published", steps, None, None))
    # Short waits: a Python signal handler runs only when the main thread
    # gets control, and a long blocking wait may not be interrupted.
    deadline = time.monotonic() + 120
    while not go.wait(0.05) and time.monotonic() < deadline:
        pass  # the parent kills us in here
    channel.close()


def ring_owner_main(run_id: str, out, ending: str) -> None:
    """Create a ring, report its name, then end the way ``ending`` says."""
    if ending == "prior-handler":

        def prior(signum, frame):
            out.put(("owner", "prior-ran", signum, None, None))
            raise SystemExit(3)

        signal.signal(signal.SIGTERM, prior)
    ring = BitmaskRing.create(run_id=run_id, readers=["r"], max_rows=2, width=2)
    out.put(("owner", "created", ring.handle.name, None, None))
    if ending == "return":
        return  # never closed: atexit must remove it
    if ending == "os-exit":
        out.close()
        out.join_thread()  # flush the report: os._exit skips the queue's feeder
        os._exit(0)
    for _ in range(1200):
        time.sleep(0.1)  # the parent's signal arrives in here
