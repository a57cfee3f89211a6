"""Dynamic batching of requests to one expert, sans-IO.

A server runs requests in batches of up to ``max_batch`` rows: larger batches
use the accelerator better, and waiting for one costs latency.  A
:class:`Batcher` holds the requests waiting, first in first out, and says
when a batch is ready:

* when it is full: the next request would not fit (or it holds exactly
  ``max_batch`` rows), so waiting longer gains nothing;
* when its oldest request has waited ``max_wait`` seconds.

A request is never split across batches; one larger than ``max_batch`` runs
as a batch of its own.  The caller keeps the requests themselves (the
batcher sees only a key and a row count), runs the batches it is handed in
the order given, and calls :meth:`Batcher.due` at :meth:`Batcher.deadline`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable


class Batcher:
    """Requests waiting to be batched, in arrival order.  Since a batch is
    handed out as soon as the next request would not fit, at most
    ``max_batch`` rows ever wait."""

    def __init__(self, max_batch: int, max_wait: float):
        """``max_batch``: rows per batch, at least 1; ``max_wait``: the seconds a
        request may wait for others, finite and non-negative (0: every request
        runs at once).  ValueError otherwise."""
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

    def _take(self) -> list[Hashable]:
        batch = [key for key, _, _ in self._waiting]
        self._waiting.clear()
        self._rows = 0
        return batch

    def add(self, key: Hashable, rows: int, now: float) -> list[list[Hashable]]:
        """Queue request ``key`` of ``rows`` rows, arrived at ``now``, and return
        the batches ready to run now, oldest first (each a list of keys in
        arrival order): the requests already waiting, if this one does not fit
        with them; this one alone, if it is larger than ``max_batch``; and the
        requests waiting with this one, if they fill a batch or the oldest has
        waited ``max_wait``.  ValueError for rows < 1, and then nothing changes."""
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"a request has a whole number of rows, at least 1, not {rows!r}")
        ready = []
        if self._waiting and self._rows + rows > self.max_batch:
            ready.append(self._take())
        if rows > self.max_batch:
            ready.append([key])
            return ready
        self._waiting.append((key, rows, now))
        self._rows += rows
        if self._rows >= self.max_batch or now >= self._waiting[0][2] + self.max_wait:
            ready.append(self._take())
        return ready

    def due(self, now: float) -> list[list[Hashable]]:
        """The batch of every request waiting, if the oldest has waited
        ``max_wait`` by ``now`` (as one list in a list), else ``[]``."""
        if self._waiting and now >= self._waiting[0][2] + self.max_wait:
            return [self._take()]
        return []

    def deadline(self) -> float | None:
        """When the oldest request waiting will have waited ``max_wait``, or None
        if none waits."""
        return self._waiting[0][2] + self.max_wait if self._waiting else None

    def flush(self) -> list[list[Hashable]]:
        """Every request waiting, as one batch, whatever the time (on shutdown,
        say); ``[]`` if none waits."""
        return [self._take()] if self._waiting else []
