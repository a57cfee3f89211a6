"""Dynamic batching of requests to one expert, sans-IO.

A server runs requests in batches of up to ``max_batch`` rows: larger batches
use the accelerator better, and waiting for one costs latency.  A
:class:`Batcher` holds the requests waiting, first in first out, and the
server's worker *takes* a batch whenever it is free and one is ready:

* the requests waiting fill a batch (``max_batch`` rows or more), or
* the oldest has waited ``max_wait`` seconds;

and then it takes as many as fit, oldest first.  Batches are formed when
the worker takes them, not when requests arrive: while one batch runs, the
requests that come meanwhile wait together and leave as one full batch,
rather than as the many small ones that their arrival times would cut.

A request is never split across batches; one larger than ``max_batch``
runs as a batch of its own.  The caller keeps the requests themselves (the
batcher sees only a key and a row count) and waits until
:meth:`Batcher.deadline` or the next request before asking again.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable


class Batcher:
    """Requests waiting to be batched, in arrival order."""

    def __init__(self, max_batch: int, max_wait: float):
        """``max_batch``: rows per batch, at least 1; ``max_wait``: the seconds a
        request may wait for others, finite and non-negative (0: a free worker
        takes whatever waits at once).  ValueError otherwise."""
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch is a whole number of rows, at least 1, not {max_batch!r}")
        if not 0 <= max_wait < math.inf:
            raise ValueError(f"max_wait is finite and non-negative, not {max_wait!r}")
        self.max_batch = max_batch
        self.max_wait = float(max_wait)
        self._waiting: deque[tuple[Hashable, int, float]] = deque()  # (key, rows, arrived)
        self._rows = 0

    @property
    def pending(self) -> int:
        """The number of requests waiting."""
        return len(self._waiting)

    @property
    def rows_pending(self) -> int:
        """The rows of the requests waiting, together."""
        return self._rows

    def oldest(self) -> float | None:
        """When the oldest request waiting arrived (None if none waits)."""
        return self._waiting[0][2] if self._waiting else None

    def add(self, key: Hashable, rows: int, now: float) -> None:
        """Queue request ``key`` of ``rows`` rows, arrived at ``now``.
        ValueError for rows < 1, and then nothing changes."""
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"a request has a whole number of rows, at least 1, not {rows!r}")
        self._waiting.append((key, rows, now))
        self._rows += rows

    def ready(self, now: float) -> bool:
        """Whether a free worker should take a batch at ``now``: the requests
        waiting fill one, or the oldest has waited ``max_wait``."""
        return bool(self._waiting) and (self._rows >= self.max_batch or now >= self._waiting[0][2] + self.max_wait)

    def take(self, now: float) -> list[Hashable]:
        """The next batch if one is :meth:`ready` (else ``[]``): the oldest
        requests, in arrival order, as many as fit in ``max_batch`` rows (at
        least one, so an oversize request goes alone)."""
        if not self.ready(now):
            return []
        batch, rows = [], 0
        while self._waiting and (not batch or rows + self._waiting[0][1] <= self.max_batch):
            key, n, _ = self._waiting.popleft()
            batch.append(key)
            rows += n
        self._rows -= rows
        return batch

    def deadline(self) -> float | None:
        """When the oldest request waiting will have waited ``max_wait`` (None if
        none waits); a full batch is ready before that."""
        return self._waiting[0][2] + self.max_wait if self._waiting else None

    def flush(self) -> list[list[Hashable]]:
        """Every request waiting, in batches of at most ``max_batch`` rows, whatever
        the time (on shutdown, say); ``[]`` if none waits."""
        batches = []
        while self._waiting:
            batches.append(self.take(math.inf))
        return batches
