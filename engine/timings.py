"""Per-rank latency samples of the step loop, reported as p50 / p99."""

from __future__ import annotations

import statistics
from collections import defaultdict

import msgspec


class Percentiles(msgspec.Struct, frozen=True):
    p50: float
    p99: float
    count: int


def percentiles(values: list[float]) -> Percentiles:
    if not values:
        return Percentiles(0.0, 0.0, 0)
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return Percentiles(round(statistics.median(ordered), 4), round(p99, 4), len(ordered))


class Timings:
    """Named lists of millisecond samples (one per step and rank)."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = defaultdict(list)

    def add(self, name: str, ms: float) -> None:
        self.samples[name].append(ms)

    def export(self) -> dict[str, list[float]]:
        return {k: [round(x, 4) for x in v] for k, v in self.samples.items()}
