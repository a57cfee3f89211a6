"""Choosing among the peers that serve one expert, and when to hedge.

Several peers may serve the same expert.  :class:`Servers` remembers how each
one did and puts them in the order to try:

* a server that has answered is ranked by the EWMA of its latency;
* a server never measured ranks with the best EWMA among the candidates and
  ahead of it on that tie, so it is tried and measured once (with hedging,
  a slow newcomer costs at most one hedge delay), then placed by its EWMA;
* a server whose last request failed goes last until its back-off has passed:
  ``BACKOFF_FACTOR`` × its EWMA (at least ``BACKOFF_MIN``), doubled for each
  further failure in a row, at most ``BACKOFF_MAX``; one success clears it.

:meth:`Servers.hedge_delay` is how long to wait for the first server before
also asking the second: a high percentile of the recent latencies across all
servers, with a margin, so that only the slowest few requests are hedged.
Ties are broken by the servers' keys (or their ``repr``, for keys that do not
compare), so every call with the same history gives the same order.
:meth:`Servers.health` says in one word what the record shows of a server
(``ok``, ``backed-off``, ``failing``), for listings.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

ALPHA = 0.3  # weight of a new latency sample in the EWMA: follows a change within a few requests
SAMPLES = 64  # recent latencies kept, across servers, for the hedge delay
BACKOFF_FACTOR = 2.0  # a failed server waits this many times its EWMA ...
BACKOFF_MIN = 1.0  # ... but at least a second (before any doubling) ...
BACKOFF_MAX = 60.0  # ... doubling per failure in a row, and at most a minute
HEDGE_QUANTILE = 0.95  # hedge the slowest one in twenty requests ...
HEDGE_MARGIN = 1.5  # ... with room for jitter above that percentile ...
HEDGE_FLOOR = 0.005  # ... and never sooner than 5 ms, which would double the load for nothing
HEDGE_DEFAULT = 0.1  # before any sample


@dataclass
class _Record:
    ewma: float | None = None  # seconds; None until the first success
    failures: int = 0  # in a row, since the last success
    retry_at: float = -math.inf  # the end of the back-off after the last failure


class Servers:
    """What one client has seen of the servers of one expert (keys: any hashable)."""

    def __init__(self) -> None:
        self._records: dict[Hashable, _Record] = {}
        self._samples: deque[float] = deque(maxlen=SAMPLES)

    def observe(self, server: Hashable, seconds: float, ok: bool, now: float) -> None:
        """Record a request to ``server`` that took ``seconds`` and ended at
        ``now``: a success feeds its EWMA and the recent latencies, and ends any
        back-off; a failure (whose duration says little: a refusal is quick, a
        timeout is the caller's limit) starts or doubles its back-off.
        ValueError for a duration that is negative or not finite."""
        if not 0 <= seconds < math.inf:
            raise ValueError(f"a request's duration is finite and non-negative, not {seconds!r}")
        record = self._records.setdefault(server, _Record())
        if ok:
            record.ewma = seconds if record.ewma is None else (1 - ALPHA) * record.ewma + ALPHA * seconds
            record.failures = 0
            record.retry_at = -math.inf
            self._samples.append(seconds)
        else:
            record.failures += 1
            base = max(BACKOFF_MIN, BACKOFF_FACTOR * (record.ewma or 0.0))
            record.retry_at = now + min(BACKOFF_MAX, base * 2 ** (record.failures - 1))

    def ewma(self, server: Hashable) -> float | None:
        """The EWMA of ``server``'s latency in seconds; None if it never answered."""
        record = self._records.get(server)
        return record.ewma if record else None

    def failures(self, server: Hashable) -> int:
        """How many requests to ``server`` failed in a row, up to now."""
        record = self._records.get(server)
        return record.failures if record else 0

    def backing_off(self, server: Hashable, now: float) -> bool:
        """Whether ``server`` failed and its back-off has not passed by ``now``."""
        record = self._records.get(server)
        return record is not None and now < record.retry_at

    def health(self, server: Hashable, now: float) -> str | None:
        """What this record says of ``server`` at ``now``: ``"backed-off"`` while the
        back-off after its last failure lasts, ``"failing"`` once it has passed but
        no answer came since (the last request failed), ``"ok"`` if its last request
        answered; None if it was never asked."""
        record = self._records.get(server)
        if record is None:
            return None
        if record.failures:
            return "backed-off" if now < record.retry_at else "failing"
        return "ok"

    def known(self) -> list[Hashable]:
        """The servers this record has seen a request to, in the order first seen."""
        return list(self._records)

    def order(self, servers: Iterable[Hashable], now: float) -> list[Hashable]:
        """``servers`` (duplicates dropped) in the order to try them at ``now``:
        those not backing off by EWMA, the unmeasured ones with the best EWMA
        among them and first on that tie; then those backing off, the one
        whose back-off ends first first."""
        candidates = list(dict.fromkeys(servers))
        ready = [s for s in candidates if not self.backing_off(s, now)]
        waiting = [s for s in candidates if self.backing_off(s, now)]
        known = [e for e in map(self.ewma, ready) if e is not None]
        best = min(known, default=0.0)

        def rank(s: Hashable) -> tuple[float, int]:
            ewma = self.ewma(s)
            return (best, 0) if ewma is None else (ewma, 1)

        ready = _sorted(ready, rank)
        waiting = _sorted(waiting, lambda s: (self._records[s].retry_at, 0))
        return ready + waiting

    def hedge_delay(self) -> float:
        """Seconds to wait for the first server before also asking the second:
        ``HEDGE_MARGIN`` × the ``HEDGE_QUANTILE`` percentile (nearest rank) of
        the last ``SAMPLES`` latencies across servers, at least ``HEDGE_FLOOR``;
        ``HEDGE_DEFAULT`` before any sample."""
        if not self._samples:
            return HEDGE_DEFAULT
        ordered = sorted(self._samples)
        rank = max(1, math.ceil(HEDGE_QUANTILE * len(ordered)))
        return max(HEDGE_FLOOR, HEDGE_MARGIN * ordered[rank - 1])


def _sorted(items: list[Hashable], rank) -> list[Hashable]:
    """``items`` by ``rank``, ties by the key itself, or by its repr when keys
    do not compare."""
    try:
        return sorted(items, key=lambda s: (*rank(s), s))
    except TypeError:
        return sorted(items, key=lambda s: (*rank(s), repr(s)))
