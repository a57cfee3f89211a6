"""Coalescing one client's concurrent calls to an expert into fewer requests, sans-IO.

Many callers sharing one remote expert would each send a request of a row or
two, and every request costs both ends the same CPU whatever its size (a
stream, framing, scheduling).  A :class:`Coalescer` gathers them instead:
calls whose inputs agree in all but their first dimension (the same
*signature*) wait together and leave as one request, their rows
concatenated, and the client splits the answer back by rows.  A call leaves

* at once, with whatever of its signature waits beside it, while fewer than
  ``depth`` requests are in flight: a lone caller is never delayed;
* otherwise as soon as the calls waiting fill a request (``limit`` rows, the
  most one request may carry: the server's ``max_batch``, say), or when a
  request in flight comes back (:meth:`Coalescer.done`).

So a call waits only while an earlier request is in flight, when the server,
busy with that one, would have queued it anyway.  A call is never split: one
larger than ``limit`` leaves alone.  As with :class:`~experts.batching.Batcher`
(one per signature here), the caller keeps the calls themselves; the
coalescer sees keys and row counts.
"""

from __future__ import annotations

from collections.abc import Hashable

from .batching import Batcher


class Coalescer:
    """Calls waiting to leave in a request, by signature, and the requests in flight."""

    def __init__(self, depth: int = 1):
        """``depth``: the requests in flight before calls wait to be coalesced, at least 1."""
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth is a whole number of requests, at least 1, not {depth!r}")
        self.depth = depth
        self.in_flight = 0
        self._groups: dict[Hashable, Batcher] = {}  # signature -> its calls waiting (max_batch: its limit)

    @property
    def pending(self) -> int:
        """The number of calls waiting."""
        return sum(group.pending for group in self._groups.values())

    def add(self, key: Hashable, signature: Hashable, rows: int, limit: int, now: float) -> None:
        """Queue call ``key`` of ``rows`` rows whose inputs have ``signature``, made at
        ``now``.  ``limit``: the most rows one request of that signature may carry; the
        limit given with the first call of a group holds until the group has left.
        ValueError for rows or a limit below 1, and then nothing changes."""
        group = self._groups.get(signature) or Batcher(limit, 0.0)
        group.add(key, rows, now)
        self._groups[signature] = group

    def take(self, now: float) -> list[tuple[Hashable, list[Hashable]]]:
        """The requests to send at ``now``, each a signature and its calls' keys in
        the order they came, the group with the oldest call first; each counts
        as in flight until :meth:`done`."""
        requests = []
        for signature, group in sorted(self._groups.items(), key=lambda item: item[1].oldest()):
            while group.pending and (self.in_flight < self.depth or group.rows_pending >= group.max_batch):
                requests.append((signature, group.take(now)))
                self.in_flight += 1
            if not group.pending:
                del self._groups[signature]
        return requests

    def done(self) -> None:
        """A request :meth:`take` gave has been answered, has failed or was abandoned.
        ValueError when none is in flight."""
        if not self.in_flight:
            raise ValueError("no request is in flight")
        self.in_flight -= 1
