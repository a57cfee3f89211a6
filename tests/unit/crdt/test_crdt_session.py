"""crdt.session over in-memory channels: two replicas that diverged end equal,
a side that may not read gets nothing, and a bad message fails the session."""

from __future__ import annotations

import msgpack
import pytest
import trio

from crdt import session
from crdt.change import decode_change
from crdt.document import Document
from crdt.reconcile import ReconcileError
from crdt.session import sync_session
from crdt_helpers import Key, commit

OWNER, WRITER = Key("owner"), Key("writer")


class MemoryChannel:
    """One end of an in-memory bidi channel; items cross as msgpack, as over RPC."""

    def __init__(self, send: trio.MemorySendChannel, receive: trio.MemoryReceiveChannel):
        self._send, self._receive = send, receive
        self.sent_bytes = 0

    async def send(self, item: object) -> None:
        data = msgpack.packb(item, use_bin_type=True)
        self.sent_bytes += len(data)
        await self._send.send(data)

    async def receive(self) -> object:
        return msgpack.unpackb(await self._receive.receive(), raw=False)

    async def end(self) -> None:
        await self._send.aclose()


def channel_pair() -> tuple[MemoryChannel, MemoryChannel]:
    a_to_b, b_from_a = trio.open_memory_channel(1)
    b_to_a, a_from_b = trio.open_memory_channel(1)
    return MemoryChannel(a_to_b, a_from_b), MemoryChannel(b_to_a, b_from_a)


class Replica:
    """A document with its changes by sync key, standing in for a store."""

    def __init__(self) -> None:
        self.doc = Document(OWNER.pk, "run")
        self.wires: dict[bytes, bytes] = {}

    def make(self, key: Key, fill) -> None:
        change = commit(self.doc, key, fill)
        self.wires[change.key] = change.wire

    def take(self, batch: list[bytes]) -> int:
        new = 0
        for wire in batch:
            for change in self.doc.receive(decode_change(wire)):
                self.wires[change.key] = change.wire
                new += 1
        return new

    def stored(self, keys: list[bytes]) -> list[bytes]:
        return [self.wires[k] for k in keys]


def diverged(common: int, only_a: int, only_b: int) -> tuple[Replica, Replica]:
    a, b = Replica(), Replica()
    a.make(OWNER, lambda tx: tx.grant(WRITER.pk))
    for i in range(common):
        a.make(OWNER, lambda tx: tx.set([f"k{i}"], i))
    b.take(list(a.wires.values()))
    for i in range(only_a):
        a.make(OWNER, lambda tx: tx.inc(["steps"], 1))
    for i in range(only_b):
        b.make(WRITER, lambda tx: tx.add(["members"], f"w{i}"))
    return a, b


async def run(a: Replica, b: Replica, *, a_reads: bool = True, b_reads: bool = True):
    ends = channel_pair()
    results = {}

    async def side(name, replica, channel, initiator, peer_reads):
        results[name] = await sync_session(
            channel, replica.doc.items, initiator=initiator,
            wires=replica.stored if peer_reads else None, ingest=replica.take)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(side, "a", a, ends[0], True, b_reads)
        nursery.start_soon(side, "b", b, ends[1], False, a_reads)
    return results["a"], results["b"], ends


async def test_diverged_replicas_end_equal_and_count_what_moved(monkeypatch):
    monkeypatch.setattr(session, "BATCH_BYTES", 2000)  # several batches each way
    a, b = diverged(300, 40, 25)
    result_a, result_b, _ = await run(a, b)
    assert a.doc.get() == b.doc.get() and a.doc.heads == b.doc.heads
    assert a.doc.get()["steps"] == 40 and len(a.doc.get()["members"]) == 25
    assert (result_a.sent, result_a.received) == (40, 25)
    assert (result_b.sent, result_b.received) == (25, 40)


async def test_equal_replicas_exchange_a_few_bytes():
    a, b = diverged(300, 0, 0)
    result_a, result_b, ends = await run(a, b)
    assert result_a.sent == result_b.sent == 0
    assert ends[0].sent_bytes + ends[1].sent_bytes < 64


async def test_a_side_that_may_not_read_gets_nothing_but_still_gives():
    a, b = diverged(10, 5, 5)
    result_a, result_b, _ = await run(a, b, b_reads=False)
    assert result_a.sent == 0 and result_b.received == 0  # b was not sent a's changes
    assert result_a.received == 5  # a took b's
    assert "members" in a.doc.get() and "steps" not in b.doc.get()


async def test_a_malformed_reconciliation_message_fails_the_session():
    a, _ = diverged(10, 0, 0)
    ours, theirs = channel_pair()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(theirs.send, [[b"\x00" * 41, 1, b"short"]])
            with pytest.raises(ReconcileError):
                await sync_session(ours, a.doc.items, initiator=False, wires=a.stored, ingest=a.take)
            nursery.cancel_scope.cancel()
