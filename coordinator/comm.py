"""What the coordinator needs from a runtime: the ``Comm`` protocol.

``coordinator.runtime.Runtime`` implements it over gloo groups; tests
drive the coordinator with in-process fakes (``tests.coordinator.fakes``).
Every call names its ``operation`` and ``step``, so a failure says where
it happened. Arrays are int64 numpy arrays.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import numpy as np


class Comm(Protocol):
    """What the coordinator needs from a runtime (tests provide fakes)."""

    rank: int
    # Every rank's host name; only read with agreement_levels "host".
    hosts: tuple[str, ...]

    def members(self, group: str) -> tuple[int, ...]: ...

    def all_gather(
        self, group: str, row: np.ndarray, *, operation: str, step: int
    ) -> np.ndarray: ...

    def all_gather_start(self, group: str, row: np.ndarray, *, operation: str, step: int) -> Any:
        """``all_gather`` posted; the result has ``wait() -> int64[members, n]``."""

    def all_reduce(
        self, group: str, row: np.ndarray, op: Literal["band", "max"], *, operation: str, step: int
    ) -> np.ndarray: ...

    def gather(
        self, group: str, row: np.ndarray, dst: int, *, operation: str, step: int
    ) -> np.ndarray | None: ...

    def broadcast(
        self, group: str, buf: np.ndarray, src: int, *, operation: str, step: int
    ) -> np.ndarray: ...

    def send(
        self, group: str, dst: int, payload: np.ndarray, *, tag: int, operation: str, step: int
    ) -> None: ...

    def recv(
        self, group: str, src: int, out: np.ndarray, *, tag: int, operation: str, step: int
    ) -> None: ...
