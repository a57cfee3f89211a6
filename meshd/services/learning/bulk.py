"""Tensor payloads over the TCP bulk lane (:mod:`meshd.lane`), beside the QUIC stream that heads them.

QUIC moves ~250 MB/s per stream and costs ~8 ns of CPU per byte across both
ends (aioquic is pure Python); the lane moves GB/s.  So a member that sends
a tensor set to a peer with a direct path sends only the signed head and the
tensor headers over QUIC and *lends* the payloads: :meth:`Bulk.lend`
registers them as numbered chunks (views of the tensors' memory, no copy)
under a random ticket that only that peer is told, and the peer fetches
them with :meth:`Bulk.fetch` from this node's lane server (token method
``learning.lane``).  The chunk ids are derived from the ticket
(:func:`learn.wire.chunk_ids`), so nobody else can name them; the lane's
AES-GCM keys come from the authenticated QUIC connection, so every byte
is the lender's as surely as over QUIC.
A peer without a direct path, or whose lane fails, gets the frames over
QUIC (the caller retries without the lane).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

import trio

from learn.wire import chunk_ids, lent_chunks

from ...identity import PeerId
from ...lane import LaneConfig, LaneError, LaneServer, open_lane
from ...service import Host

log = logging.getLogger("meshd.learning")

METHOD = "learning.lane"
NO_LANE = "no bulk lane"  # how a receiver that could not use the lane says so (the sender resends over QUIC)


@dataclass
class Loan:
    """One tensor set lent to one peer: its ticket, and which of its chunks were fetched."""

    ticket: bytes
    count: int
    nbytes: int
    fetched: set = field(default_factory=set)
    done: trio.Event = field(default_factory=trio.Event)  # every chunk fetched at least once


class Bulk:
    """This node's side of the learning lane: lends payloads to peers and fetches theirs."""

    def __init__(self, host: Host, *, enabled: bool, min_bytes: int = 0, limits: LaneConfig = LaneConfig()):
        self.host = host
        self.enabled = enabled  # serve a lane and fetch from peers' (config learning.lane)
        self.min_bytes = min_bytes  # lend only sets of this many payload bytes or more (learning.lane_min_bytes)
        self.server = LaneServer(host, self._chunk, limits=limits) if enabled else None
        self.lent = 0  # payload bytes peers fetched from this node's lane
        self.fetched = 0  # ... this node fetched from peers' lanes
        self._chunks: dict[bytes, tuple[memoryview, Loan, int]] = {}  # id -> (chunk, its loan, its number)

    def usable(self, peer: PeerId, named: list) -> bool:
        """Whether to lend ``named`` ((name, Encoded) pairs) to ``peer``: our lane is up, the
        QUIC path to it is direct, and their payloads come to ``min_bytes`` or more (a
        lane's setup, a token call, a TCP connection and its key exchange, costs more
        than a small set's bytes over QUIC)."""
        conn = self.host.live(peer)
        return self.server is not None and self.server.port is not None and conn is not None \
            and conn.path == "direct" and sum(memoryview(enc.payload).nbytes for _, enc in named) >= self.min_bytes

    @contextlib.contextmanager
    def lend(self, named: list) -> Iterator[Loan]:
        """Lend the payloads of ``named`` ((name, Encoded) pairs, unchanged until
        the block ends) as numbered chunks under a fresh ticket, for the block."""
        chunks = lent_chunks(named)
        loan = Loan(os.urandom(32), len(chunks), sum(len(c) for c in chunks))
        ids = chunk_ids(loan.ticket, len(chunks))
        self._chunks.update((cid, (chunk, loan, j)) for j, (cid, chunk) in enumerate(zip(ids, chunks)))
        if not chunks:
            loan.done.set()
        try:
            yield loan
        finally:
            for cid in ids:
                del self._chunks[cid]

    def _chunk(self, cid: bytes) -> memoryview | None:
        entry = self._chunks.get(cid)
        if entry is None:
            return None
        chunk, loan, number = entry
        self.lent += len(chunk)
        loan.fetched.add(number)
        if len(loan.fetched) == loan.count:
            loan.done.set()
        return chunk

    async def fetch(self, peer: PeerId, ticket: bytes, count: int) -> AsyncIterator[memoryview]:
        """The ``count`` chunks ``peer`` lent under ``ticket``, in order, over a
        lane opened for this call, each a view that the next one overwrites;
        LaneError if no lane opens, it breaks, or the peer lacks a chunk, or
        this node does not use lanes."""
        lane = await open_lane(self.host, peer, method=METHOD) if self.enabled else None
        if lane is None:
            raise LaneError(f"no lane to {peer.short()}")
        async with lane:
            async with contextlib.aclosing(lane.fetch(chunk_ids(ticket, count), borrow=True)) as chunks:
                async for _, data in chunks:
                    if data is None:
                        raise LaneError(f"{peer.short()} no longer lends that tensor set")
                    self.fetched += len(data)
                    yield data
