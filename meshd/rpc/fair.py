"""Which served calls may run now: fair between peers once the node is busy (sans-IO).

The rule (docs/security.md, "Fairness between peers"): a call starts at once
while the node runs fewer than ``busy`` calls in all, or while its peer runs
fewer than ``share``; otherwise it waits behind the earlier waiting calls of
its peer.  Each call that ends lets waiting calls start, those of the peer
with the fewest calls in flight (running or waiting) first, between equals
the one waiting longest, as far as the rule allows.  So calls that stay (a
slow handler, an answer nobody reads) hold at most a share of a busy node per
peer, and a peer with few calls in flight is served before a flood's backlog.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, deque
from typing import Generic, Hashable, TypeVar

W = TypeVar("W")


class FairShare(Generic[W]):
    """Counts the calls each peer runs and keeps, in order, those that wait (as ``W``).

    With ``busy`` infinite (the default) no call ever waits, and this only counts.
    """

    def __init__(self, busy: float = math.inf, share: int = 1):
        self.busy = busy
        self.share = share
        self.total = 0  # calls running, all peers
        self.waiting = 0  # calls waiting, all peers
        self._running: Counter[Hashable] = Counter()
        self._waiting: dict[Hashable, deque[tuple[int, W]]] = {}  # per peer, oldest first
        self._order = itertools.count()

    def running(self, peer: Hashable) -> int:
        """Calls of ``peer`` running now."""
        return self._running[peer]

    def try_start(self, peer: Hashable) -> bool:
        """Count a new call of ``peer`` as running and return True if it may start
        now; False (nothing counted) if it must wait: then pass it to :meth:`wait`."""
        if peer in self._waiting or not self._may_start(peer):
            return False
        self._start(peer)
        return True

    def wait(self, peer: Hashable, waiter: W) -> None:
        """Queue ``waiter``, a call of ``peer`` that :meth:`try_start` did not start."""
        self._waiting.setdefault(peer, deque()).append((next(self._order), waiter))
        self.waiting += 1

    def leave(self, peer: Hashable, waiter: W) -> None:
        """Forget ``waiter``, still waiting, whose call will not run after all."""
        queue = self._waiting[peer]
        queue.remove(next(entry for entry in queue if entry[1] is waiter))
        if not queue:
            del self._waiting[peer]
        self.waiting -= 1

    def end(self, peer: Hashable) -> list[W]:
        """A running call of ``peer`` ended: the waiters whose calls start now
        (counted as running), in the order they were chosen."""
        self._running[peer] -= 1
        if not self._running[peer]:
            del self._running[peer]
        self.total -= 1
        started = []
        while True:
            ready = [peer for peer in self._waiting if self._may_start(peer)]
            if not ready:
                return started
            peer = min(ready, key=self._precedence)
            queue = self._waiting[peer]
            started.append(queue.popleft()[1])
            if not queue:
                del self._waiting[peer]
            self.waiting -= 1
            self._start(peer)

    def _precedence(self, peer: Hashable) -> tuple[int, int]:
        """Fewest calls in flight first; between equals, the oldest waiting call."""
        queue = self._waiting[peer]
        return self._running[peer] + len(queue), queue[0][0]

    def _may_start(self, peer: Hashable) -> bool:
        return self.total < self.busy or self._running[peer] < self.share

    def _start(self, peer: Hashable) -> None:
        self._running[peer] += 1
        self.total += 1
