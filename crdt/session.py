"""One sync session between two replicas, over any bidirectional channel.

The session runs :class:`~crdt.reconcile.Reconciler` to completion, then
both sides send the changes the other lacks at the same time (so neither
stalls on the transport's flow control) and end their direction.  The
channel is a small protocol (``send``, ``receive``, ``end``) that meshd
implements with a bidi RPC call and the tests with in-memory channels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import trio

from .reconcile import ItemSet, Reconciler

BATCH_BYTES = 4 << 20  # changes per item sent


class Channel(Protocol):
    async def send(self, item: object) -> None: ...

    async def receive(self) -> object:
        """The peer's next item; trio.EndOfChannel once it has ended."""

    async def end(self) -> None: ...


@dataclass
class SyncResult:
    sent: int  # changes we had that the peer lacked (0 sent if it may not read)
    received: int  # new changes the peer's batches held
    rounds: int  # reconciliation messages received


async def sync_session(channel: Channel, items: ItemSet, *, initiator: bool,
                       wires: Callable[[list[bytes]], Iterable[bytes]] | None,
                       ingest: Callable[[object], int]) -> SyncResult:
    """Reconcile ``items`` with the peer's, then exchange the missing changes.

    ``wires(keys)`` gives the stored changes for sync keys (None: the peer
    may not read, so we send nothing); ``ingest(batch)`` takes one list of
    change bytes from the peer and returns how many were new.  ``items`` is
    copied first, so changes applied meanwhile do not disturb the session.
    Raises ReconcileError for a bad message and whatever ``ingest`` raises.
    """
    reconciler = Reconciler(ItemSet(items))
    if initiator:
        await channel.send(reconciler.initiate())
    while not reconciler.done:
        message = reconciler.receive(await channel.receive())
        if message is not None:
            await channel.send(message)
    received = 0
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_send_changes, channel, wires, sorted(reconciler.have))
            while True:
                try:
                    batch = await channel.receive()
                except trio.EndOfChannel:
                    break
                received += ingest(batch)
    except BaseExceptionGroup as group:  # one failure: give it to the caller as it is
        while isinstance(group, BaseExceptionGroup):
            group = group.exceptions[0]
        raise group from None
    return SyncResult(len(reconciler.have) if wires else 0, received, reconciler.rounds)


async def _send_changes(channel: Channel, wires, keys: list[bytes]) -> None:
    batch, size = [], 0
    for wire in wires(keys) if wires and keys else ():
        if size + len(wire) > BATCH_BYTES and batch:
            await channel.send(batch)
            batch, size = [], 0
        batch.append(wire)
        size += len(wire)
    if batch:
        await channel.send(batch)
    await channel.end()
