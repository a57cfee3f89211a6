"""Datagrams read from the socket and not yet processed, served fairly between connections (sans-IO).

The kernel keeps a UDP socket's datagrams in one queue, first in, first out.
A peer with megabytes of receive credit can fill it faster than the node
decrypts and parses (on loopback a node takes in about 100 MB/s), and every
other peer's datagrams then wait behind that backlog: measured with the
abuse benchmark's slow readers, 4-11 MB queued in the kernel and honest
pings of 50-130 ms (docs/security.md, "Slow readers and the socket's queue").  So the endpoint
reads what the socket holds into a :class:`FairInbox`, one queue per
connection, and processes the queues in turn, a datagram of each at a time:
a datagram waits behind at most one datagram of each other connection, not
behind all of them.  Datagrams of no known connection (new Initials, STUN,
garbage) share one queue.

The inbox holds at most ``max_bytes``; past that, the longest queue loses
its newest datagram (as a full socket would drop it, but from the peer that
sends the most, not from whoever comes next), and QUIC's loss recovery sends
it again more slowly.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
Datagram = tuple[bytes, tuple]


class _Queue:
    """One key's datagrams, oldest first, and their bytes."""

    __slots__ = ("items", "bytes")

    def __init__(self) -> None:
        self.items: deque[Datagram] = deque()
        self.bytes = 0


class FairInbox(Generic[K]):
    """Datagrams waiting to be processed, in one FIFO queue per key, at most ``max_bytes`` in all."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0  # all queues
        self.dropped = 0  # datagrams dropped so far to stay within max_bytes
        self._queues: dict[K, _Queue] = {}  # in the order they are served next

    def __bool__(self) -> bool:
        return bool(self._queues)

    def put(self, key: K, data: bytes, addr: tuple) -> None:
        """Queue a datagram behind the others of ``key``; past ``max_bytes``, drop the
        newest datagrams of the longest queue (perhaps this one) until within it."""
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = _Queue()
        queue.items.append((data, addr))
        queue.bytes += len(data)
        self.bytes += len(data)
        while self.bytes > self.max_bytes:
            self._drop_from_longest()

    def take(self, n: int) -> list[Datagram]:
        """Up to ``n`` datagrams, one of each queue in turn, oldest first within a queue.

        A queue that gives one goes to the back of the line, so the next
        call starts where this one stopped."""
        out: list[Datagram] = []
        queues = self._queues
        while queues and len(out) < n:
            key = next(iter(queues))
            queue = queues.pop(key)
            data, addr = queue.items.popleft()
            queue.bytes -= len(data)
            self.bytes -= len(data)
            out.append((data, addr))
            if queue.items:
                queues[key] = queue
        return out

    def take_round(self, most: int) -> list[Datagram]:
        """One datagram of each queue (a turn round them all), or, while a single queue
        holds any, up to ``most`` of it: a round with several busy connections then costs
        a datagram of each, so the next round, and a quiet peer's datagram in it, comes
        soon; one connection alone still has its datagrams processed in batches."""
        return self.take(most if len(self._queues) == 1 else min(most, len(self._queues)))

    def _drop_from_longest(self) -> None:
        """Drop the newest datagram of the queue that holds the most bytes."""
        key, queue = max(self._queues.items(), key=lambda kv: kv[1].bytes)
        data, _ = queue.items.pop()
        queue.bytes -= len(data)
        self.bytes -= len(data)
        self.dropped += 1
        if not queue.items:
            del self._queues[key]
