"""A histogram with fixed buckets, as Prometheus counts them, with no I/O and no locks.

The node's own code observes values on the trio thread; an exporter reads a
:meth:`Histogram.snapshot` (taken on that thread too) and turns it into
cumulative buckets.  Observing is one ``bisect`` and two additions.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Iterable

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Seconds, for calls and lags: half a millisecond (a loopback call) to half a minute."""


class Histogram:
    """Counts of observed values per bucket: ``counts[i]`` holds the values at
    most ``bounds[i]`` and above the bound before; the last count holds those
    above every bound."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Iterable[float] = LATENCY_BUCKETS):
        self.bounds = tuple(bounds)
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError("bucket bounds must increase")
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one value."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def snapshot(self) -> dict:
        """``{"le": bounds, "counts": per bucket (one more than bounds), "sum": total}``:
        plain values, safe to hand to another thread."""
        return {"le": list(self.bounds), "counts": list(self.counts), "sum": self.sum}


def is_histogram(value: object) -> bool:
    """Whether ``value`` is a :meth:`Histogram.snapshot`."""
    return isinstance(value, dict) and "le" in value and "counts" in value


def cumulative(snapshot: dict) -> tuple[list[tuple[str, int]], int]:
    """Prometheus buckets of a snapshot: ``([(le, count at most le), ..., ("+Inf", all)], all)``."""
    out, total = [], 0
    for bound, count in zip([*snapshot["le"], "+Inf"], snapshot["counts"]):
        total += count
        out.append((bound if bound == "+Inf" else repr(float(bound)), total))
    return out, total
