"""Fault injection on one rank: the ``faults`` config section made active.

``RankFaults.of(config, rank)`` keeps only the faults that name ``rank``.
The step loop, the compile backend, the TP reader and the bitmask channel
each ask it at one point; when the section is unset every hook is absent
or a constant check, so an unset section costs nothing measurable.

What each fault does (and what must notice it):

- ``kill_rank`` / ``hang_rank`` at ``at_step``: the rank SIGKILLs itself, or
  stops making progress, at the start of that step. Its peers must raise
  ``PeerLostError`` naming it within ``distributed.step_timeout_s``.
- ``compile_delay``: the compile of a matching key sleeps first (``.inf``
  never returns); the compile deadline must turn it into
  ``grammar_timeout``, poison it for ``poison_ttl_s``, and admit it again
  once the poison expires.
- ``compile_error``: the compile of a matching key raises; the request
  fails with ``grammar_invalid`` and the exception's text, on every rank
  of its group (a host's client sees the code and the message).
- ``stall_reader``: a TP worker stops releasing the ring slots it read
  (it still computes; it has fallen behind on giving rows back); the
  writer runs out of slots and must raise ``TransportTimeout`` naming it.
  A reader that stopped altogether is caught earlier, by the step's TP
  check, as a lost peer.
- ``corrupt_frames_every``: see ``FaultsConfig``; readers count the frames
  as dropped and the run's outputs do not change.
- ``flip_mask_bit``: one applied mask bit flips; the end-of-run determinism
  check must fail the run (exit 3) naming the rank.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from gramcoord.rank_worker.config import FaultsConfig

logger = logging.getLogger(__name__)


class DelayedCompile:
    """A compile backend whose matching compiles sleep before they start.

    Runs in the compile worker's thread, so a hang here is exactly a stuck
    native compile as the compile service sees it.
    """

    def __init__(self, inner: Callable[[Any], Any], pattern: str, seconds: float, times: int):
        self._inner = inner
        self._pattern = re.compile(pattern)
        self._seconds = seconds
        self._left = times if times > 0 else -1  # -1: every matching compile
        self._lock = threading.Lock()
        # Set by tests that want a hung compile to end early.
        self.released = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __call__(self, spec: Any) -> Any:
        if self._pattern.search(spec.text):
            with self._lock:
                hit = self._left != 0
                if self._left > 0:
                    self._left -= 1
            if hit:
                logger.warning(
                    "fault: delaying the compile of %s by %s s", spec.kind, self._seconds
                )
                self.released.wait(None if math.isinf(self._seconds) else self._seconds)
        return self._inner(spec)


class FailingCompile:
    """A compile backend whose matching compiles raise (a compile error)."""

    def __init__(self, inner: Callable[[Any], Any], pattern: str, rank: int):
        self._inner = inner
        self._pattern = re.compile(pattern)
        self._rank = rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __call__(self, spec: Any) -> Any:
        if self._pattern.search(spec.text):
            logger.warning("fault: failing the compile of %s on rank %d", spec.kind, self._rank)
            raise RuntimeError(f"fault injected on rank {self._rank}: faults.compile_error")
        return self._inner(spec)


class RankFaults:
    """The faults of one rank; every query is cheap when nothing is set."""

    def __init__(self, config: FaultsConfig, rank: int) -> None:
        self.rank = rank
        self.kill_step = config.at_step if config.kill_rank == rank else -1
        self.hang_step = config.at_step if config.hang_rank == rank else -1
        delay = config.compile_delay
        self.compile_delay = delay if delay is not None and delay.rank == rank else None
        error = config.compile_error
        self.compile_error = error if error is not None and error.rank == rank else None
        stall = config.stall_reader
        self.stall = stall if stall is not None and stall.rank == rank else None
        self._stall_since: float | None = None
        flip = config.flip_mask_bit
        self.flip_step = flip.step if flip is not None and flip.rank == rank else -1
        self.corrupt_every = config.corrupt_frames_every
        # Anything the step loop must ask about each step.
        self.per_step = self.kill_step >= 0 or self.hang_step >= 0

    @classmethod
    def of(cls, config: FaultsConfig | None, rank: int) -> RankFaults:
        return cls(config or FaultsConfig(), rank)

    def on_step(self, step: int) -> None:
        """At the start of ``step``: die or hang if this rank is told to."""
        if step == self.kill_step:
            logger.warning("fault: rank %d kills itself at step %d", self.rank, step)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.hang_step:
            logger.warning("fault: rank %d hangs at step %d", self.rank, step)
            for handler in logging.getLogger().handlers:
                handler.flush()
            while True:  # until the launcher (or a test) ends the process
                time.sleep(3600)

    def wrap_compile(self, backend: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``backend``, failed or delayed as ``compile_error`` and ``compile_delay``
        say (itself when both are unset)."""
        e = self.compile_error
        if e is not None:
            backend = FailingCompile(backend, e.pattern, self.rank)
        d = self.compile_delay
        if d is None:
            return backend
        return DelayedCompile(backend, d.pattern, d.seconds, d.times)

    def holds_slot(self, step: int) -> bool:
        """A TP worker, after applying ``step``: keep its slot instead of releasing it?"""
        stall = self.stall
        if stall is None or step < stall.step:
            return False
        now = time.monotonic()
        if self._stall_since is None:
            logger.warning(
                "fault: rank %d keeps its ring slots for %s s from step %d",
                self.rank,
                stall.seconds,
                step,
            )
            self._stall_since = now
        return now - self._stall_since < stall.seconds
