"""Bytes that served calls hold, bounded node-wide and per peer (sans-IO).

A served call holds its request frame until it ends, a client-stream item
while it is being received, and each answer frame until it has been queued
to send, which for a peer that does not read its answers is until the
call's deadline.  :class:`ByteBudget` counts those bytes per peer, per
address (the IP a peer's calls came from, if the caller names one: many
fresh identities on one machine share it) and for the node; a frame that
would take its peer past ``share``, its address past ``address_share``, or
the node past ``total``, is refused (the server answers RESOURCE_EXHAUSTED
before reading the frame's body) rather than waited for: a wait would let
calls whose answers are never read stall every other peer's large calls.  Frames below
``small`` bytes are not counted: a connection's streams
(``transport.max_streams``) bound them already.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Hashable

from .errors import ResourceExhausted


class ByteBudget:
    """The bytes each peer's calls hold, and whether one more frame may be held."""

    def __init__(self, total: float = math.inf, share: float = math.inf, small: int = 64 << 10,
                 address_share: float = math.inf):
        self.total = total
        self.share = share
        self.address_share = address_share
        self.small = small
        self.held = 0  # all peers
        self.refused = 0  # frames refused so far
        self._by_peer: Counter[Hashable] = Counter()
        self._by_address: Counter[Hashable] = Counter()

    def of(self, peer: Hashable) -> int:
        """Bytes the calls of ``peer`` hold now."""
        return self._by_peer[peer]

    def take(self, peer: Hashable, size: int, address: Hashable | None = None) -> int:
        """Count a frame of ``size`` bytes as held by ``peer`` (at ``address``, if
        counted per address): the bytes counted (0 for a small frame), to :meth:`give`
        back later.

        Raises :class:`OverBudget` (nothing counted) if it would take the peer
        past its share, the address past its own, or the node past its total."""
        if size < self.small:
            return 0
        held = self._by_peer[peer]
        if held + size > self.share:
            self.refused += 1
            raise OverBudget(f"this peer's calls hold {held} bytes; one more {size}-byte frame passes "
                             f"its share of {self.share}")
        at = self._by_address[address] if address is not None else 0
        if at + size > self.address_share:
            self.refused += 1
            raise OverBudget(f"the calls from this peer's address hold {at} bytes; one more {size}-byte "
                             f"frame passes its share of {self.address_share}")
        if self.held + size > self.total:
            self.refused += 1
            raise OverBudget(f"the node's calls hold {self.held} bytes; one more {size}-byte frame passes "
                             f"its total of {self.total}: retry later")
        self._by_peer[peer] = held + size
        if address is not None:
            self._by_address[address] = at + size
        self.held += size
        return size

    def give(self, peer: Hashable, size: int, address: Hashable | None = None) -> None:
        """Give back ``size`` bytes counted by :meth:`take` for ``peer`` (and ``address``)."""
        if size:
            self.held -= size
            _less(self._by_peer, peer, size)
            if address is not None:
                _less(self._by_address, address, size)


def _less(counts: Counter, key: Hashable, size: int) -> None:
    """Take ``size`` off ``counts[key]``, dropping the key at zero."""
    left = counts[key] - size
    if left:
        counts[key] = left
    else:
        del counts[key]


class OverBudget(ResourceExhausted):
    """A frame would pass its peer's share or the node's total of held bytes
    (RESOURCE_EXHAUSTED on the wire)."""


class CallBytes:
    """The bytes one served call holds in a :class:`ByteBudget`, given back together when it ends."""

    __slots__ = ("_budget", "_peer", "_address", "held")

    def __init__(self, budget: ByteBudget, peer: Hashable, address: Hashable | None = None):
        self._budget = budget
        self._peer = peer
        self._address = address
        self.held = 0

    def take(self, size: int) -> int:
        """Hold ``size`` more bytes (:meth:`ByteBudget.take`): the bytes counted."""
        counted = self._budget.take(self._peer, size, self._address)
        self.held += counted
        return counted

    def give(self, counted: int) -> None:
        """Give back bytes :meth:`take` counted, before the call ends."""
        self.held -= counted
        self._budget.give(self._peer, counted, self._address)

    def end(self) -> None:
        """The call is over: give back all it still holds."""
        self.give(self.held)
