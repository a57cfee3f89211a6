"""Replicated documents inside meshd nodes (in-process, real QUIC on loopback).

Replicas find each other through the DHT, converge through pushes and
reconciliation, refuse peers that may not read, and make a peer that sends a
bad change lose its call.  Waiting is done on the documents' change events.
"""

from __future__ import annotations

import sqlite3
import time
from contextlib import AsyncExitStack

import pytest
import trio

import meshd
from crdt.change import sign_change
from crdt.store import Store
from meshd import Config
from meshd.services.crdt import DB_FILE, DocError

NAME = "run42"


async def open_nodes(stack: AsyncExitStack, tmp_path, names: str) -> list[meshd.Node]:
    first = await stack.enter_async_context(meshd.open_node(tmp_path / names[0], listen="127.0.0.1:0"))
    rest = [await stack.enter_async_context(
        meshd.open_node(tmp_path / name, listen="127.0.0.1:0", bootstrap=[str(first.address)]))
        for name in names[1:]]
    for node in rest:
        await node.connect(first.address)
    return [first, *rest]


async def until(node: meshd.Node, ref: str, predicate, timeout: float = 10.0) -> object:
    """Wait on the document's change events until ``predicate(value)``; return the value."""
    replica = node.service("crdt").get(ref)
    with trio.fail_after(timeout), node.service("crdt").subscribe(replica) as watcher:
        while not predicate(replica.doc.get()):
            await watcher.events.receive()
    return replica.doc.get()


async def shared_document(owner: meshd.Node, *writers: meshd.Node, readers=()) -> str:
    """A document of ``owner`` that ``writers`` may write and ``readers`` read, joined by all."""
    replica = await owner.service("crdt").open(NAME, create=True)

    def grants(tx):
        for node in writers:
            tx.grant(node.peer_id.key)
        for node in readers:
            tx.grant(node.peer_id.key, "reader")
    owner.service("crdt").write(replica, grants)
    ref = f"{owner.peer_id}/{NAME}"
    for node in (*writers, *readers):
        joined = await node.service("crdt").open(ref)
        assert joined.doc.heads == replica.doc.heads  # the join waited for a first sync
    return ref


async def test_concurrent_writers_converge(tmp_path):
    async with AsyncExitStack() as stack:
        a, b, c = await open_nodes(stack, tmp_path, "abc")
        ref = await shared_document(a, b, c)
        replicas = [node.service("crdt").get(ref) for node in (a, b, c)]
        for i, (node, replica) in enumerate(zip((a, b, c), replicas)):
            node.service("crdt").write(replica, lambda tx: (tx.inc(["steps"], 10 + i), tx.add(["members"], f"w{i}"),
                                                 tx.set(["lr"], 0.1 * i)))
        expected = {"steps": 33, "members": {"w0", "w1", "w2"}}
        for node in (a, b, c):
            value = await until(node, ref, lambda v: {k: v.get(k) for k in expected} == expected)
            assert value == replicas[0].doc.get()
        assert len({r.doc.root.encode().__repr__() for r in replicas}) == 1
        assert all(r.doc.heads == replicas[0].doc.heads for r in replicas)


async def test_write_is_on_disk_when_acknowledged(tmp_path):
    async with AsyncExitStack() as stack:
        (a,) = await open_nodes(stack, tmp_path, "a")
        replica = await a.service("crdt").open(NAME, create=True)
        change = a.service("crdt").write(replica, lambda tx: tx.set(["x"], "kept"))
        other = Store(tmp_path / "a" / DB_FILE)  # a second connection sees what is committed
        try:
            assert other.load(a.peer_id.key, NAME).get(["x"]) == "kept"
            assert change.id in other.load(a.peer_id.key, NAME)
        finally:
            other.close()


async def test_a_gap_is_repaired_by_syncing_with_the_sender(tmp_path):
    async with AsyncExitStack() as stack:
        a, b = await open_nodes(stack, tmp_path, "ab")
        ref = await shared_document(a, b)
        replica = a.service("crdt").get(ref)
        doc = replica.doc
        tx = doc.transaction()
        tx.set(["first"], 1)
        hidden = doc.prepare(tx, a.peer_id.key, a.identity.sign, 0)
        a.service("crdt").store.save(doc, [hidden])
        doc.receive(hidden)  # applied and stored, but never pushed
        a.service("crdt").write(replica, lambda tx: tx.set(["second"], 2))  # pushed; depends on the hidden one
        value = await until(b, ref, lambda v: "second" in v)
        assert value["first"] == 1
        assert b.service("crdt").get(ref).doc.pending == 0


async def test_strangers_may_not_sync_push_or_write(tmp_path):
    async with AsyncExitStack() as stack:
        a, b, stranger = await open_nodes(stack, tmp_path, "abs")
        ref = await shared_document(a, b)
        replica = a.service("crdt").get(ref)
        arg = {"doc": replica.doc.id, "owner": replica.doc.owner, "name": NAME}
        with pytest.raises(meshd.PermissionDenied):
            async with stranger.rpc.bidi(a.peer_id, "crdt.sync", arg) as channel:
                await channel.receive()
        with pytest.raises(meshd.PermissionDenied):
            await stranger.rpc.call(a.peer_id, "crdt.push", {"doc": replica.doc.id, "changes": []})
        joined = await stranger.service("crdt").open(ref)
        assert joined.doc.get() == {} and len(joined.doc) == 0
        with pytest.raises(DocError, match="may not write"):
            stranger.service("crdt").write(joined, lambda tx: tx.set(["x"], 1))


async def test_public_document_is_readable_by_anyone_but_not_writable(tmp_path):
    async with AsyncExitStack() as stack:
        a, reader = await open_nodes(stack, tmp_path, "ar")
        owner_replica = await a.service("crdt").open(NAME, create=True)
        a.service("crdt").write(owner_replica, lambda tx: (tx.grant(bytes(32), "reader"), tx.set(["model"], "gpt@7")))
        joined = await reader.service("crdt").open(f"{a.peer_id}/{NAME}")
        assert joined.doc.get() == {"model": "gpt@7"}
        with pytest.raises(DocError, match="may not write"):
            reader.service("crdt").write(joined, lambda tx: tx.set(["model"], "mine"))


async def test_bad_changes_cost_the_sender_its_call_and_nothing_else(tmp_path):
    async with AsyncExitStack() as stack:
        a, b, c = await open_nodes(stack, tmp_path, "abc")
        ref = await shared_document(a, b, readers=[c])
        replica = a.service("crdt").get(ref)
        doc = replica.doc
        before = len(doc)
        for changes in ([b"\x00garbage"], "not a list", [b"\x92\xc4\x01x\xc4\x40" + bytes(64)]):
            with pytest.raises(meshd.InvalidArgument):
                await b.rpc.call(a.peer_id, "crdt.push", {"doc": doc.id, "changes": changes})
        # Correctly signed by a reader who may not write: the call succeeds, the change is refused.
        tx = doc.transaction()
        tx.set(["x"], "from a reader")
        built = tx.build(c.peer_id.key, 1 + max(m.lamport for m in doc._meta.values()))
        forged = sign_change(doc.id, c.peer_id.key, 1 + max(m.lamport for m in doc._meta.values()),
                             list(doc.heads), int(time.time() * 1000), built, c.identity.sign)
        reply = await c.rpc.call(a.peer_id, "crdt.push", {"doc": doc.id, "changes": [forged.wire]})
        assert reply == {"new": 0}
        bad_signature = forged.wire[:-1] + bytes([forged.wire[-1] ^ 1])
        with pytest.raises(meshd.InvalidArgument, match="signature"):
            await c.rpc.call(a.peer_id, "crdt.push", {"doc": doc.id, "changes": [bad_signature]})
        assert len(doc) == before and "x" not in doc.get()
        # The node still serves: a real write from b arrives.
        b.service("crdt").write(b.service("crdt").get(ref), lambda tx: tx.set(["y"], 1))
        assert (await until(a, ref, lambda v: "y" in v))["y"] == 1


async def test_client_document_api_and_change_stream(tmp_path):
    async with AsyncExitStack() as stack:
        (a,) = await open_nodes(stack, tmp_path, "a")
        async with meshd.connect(tmp_path / "a") as client:
            with pytest.raises(meshd.InvalidArgument, match="create it first"):
                await client.document("missing")
            doc = await client.document("run", create=True)
            async with doc.changes() as events:
                await doc.counter("progress/steps").inc(5)
                async with doc.transaction() as tx:
                    tx.set("model/current", "gpt@7")
                    tx.add("members", "w1")
                    tx.add("members", 7)
                    tx.inc("progress/steps", -2)
                await doc.elements("members").remove(7)
                await doc.register("lr").set(0.01)
                seen = [await events.__anext__() for _ in range(4)]
            assert [len(e["ops"]) for e in seen] == [1, 4, 1, 1]
            assert seen[0]["ops"] == [{"op": "inc", "path": ["progress", "steps"], "total": 5}]
            assert seen[1]["ops"][0] == {"op": "set", "path": ["model", "current"], "value": "gpt@7"}
            assert seen[1]["ops"][3] == {"op": "inc", "path": ["progress", "steps"], "total": 3}
            assert all(e["local"] and e["author"] == str(a.peer_id) for e in seen)
            assert await doc.get() == {"progress": {"steps": 3}, "model": {"current": "gpt@7"},
                                       "members": ["w1"], "lr": 0.01}
            assert await doc.counter("progress/steps").value() == 3
            with pytest.raises(meshd.InvalidArgument, match="set element"):
                await doc.add("members", 1.5)
            info = await doc.info()
            assert info["changes"] == 4 and info["writable"] and info["pending"] == 0
            assert [d["doc"] for d in await client.documents()] == [f"{a.peer_id}/run"]
            assert (await client.request("crdt.compact", {"doc": "run"}))["folded"] == 4
            await client.request("crdt.forget", {"doc": "run"})
            assert await client.documents() == []
            assert a.service("crdt").store.documents() == []


async def test_new_changes_from_one_peer_are_rate_limited_and_what_came_first_is_kept(tmp_path):
    limited = Config()
    limited.crdt.peer_rate, limited.crdt.peer_burst = 0.001, 5
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(
            meshd.open_node(tmp_path / "a", listen="127.0.0.1:0", config=limited))
        b = await stack.enter_async_context(
            meshd.open_node(tmp_path / "b", listen="127.0.0.1:0", bootstrap=[str(a.address)]))
        await b.connect(a.address)
        ref = await shared_document(a, b)
        doc = b.service("crdt").get(ref).doc
        wires = []
        for i in range(10):  # made on b, never pushed by it
            tx = doc.transaction()
            tx.set(["k"], i)
            change = doc.prepare(tx, b.peer_id.key, b.identity.sign, 0)
            doc.receive(change)
            wires.append(change.wire)
        with pytest.raises(meshd.ResourceExhausted, match="new changes per second"):
            await b.rpc.call(a.peer_id, "crdt.push", {"doc": doc.id, "changes": wires})
        assert a.service("crdt").get(ref).doc.get(["k"]) == 4  # the first five were applied ...
        assert a.service("crdt").store.load(a.peer_id.key, NAME).get(["k"]) == 4  # ... and stored
        # Copies a peer already has cost nothing: pushing them again is fine.
        assert await b.rpc.call(a.peer_id, "crdt.push", {"doc": doc.id, "changes": wires[:5]}) == {"new": 0}


async def test_a_write_the_disk_refuses_is_not_acknowledged_and_not_kept(tmp_path, monkeypatch):
    async with AsyncExitStack() as stack:
        (a,) = await open_nodes(stack, tmp_path, "a")
        replica = await a.service("crdt").open(NAME, create=True)
        a.service("crdt").write(replica, lambda tx: tx.set(["kept"], 1))
        store = a.service("crdt").store

        def full_disk(batches, durable=True):
            raise sqlite3.OperationalError("database or disk is full")
        monkeypatch.setattr(store, "save_many", full_disk)
        with pytest.raises(DocError, match="disk is full"):
            a.service("crdt").write(replica, lambda tx: tx.set(["lost"], 2))
        assert replica.doc.get() == {"kept": 1}  # reloaded: memory holds what the disk holds
        monkeypatch.undo()
        a.service("crdt").write(replica, lambda tx: tx.set(["next"], 3))
        assert store.load(a.peer_id.key, NAME).get() == {"kept": 1, "next": 3}


async def test_writes_made_together_share_one_commit_and_are_on_disk_when_acknowledged(tmp_path, monkeypatch):
    async with AsyncExitStack() as stack:
        (a,) = await open_nodes(stack, tmp_path, "a")
        docs = a.service("crdt")
        replica = await docs.open(NAME, create=True)
        commits, save_many = [], docs.store.save_many
        monkeypatch.setattr(docs.store, "save_many", lambda batches, durable=True: (
            commits.append(durable), save_many(batches, durable=durable))[1])
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(docs.write_shared, replica, lambda tx, i=i: tx.set([f"k{i}"], i))
        assert commits == [True]  # eight writes, one durable transaction
        assert docs.store.load(a.peer_id.key, NAME).get() == {f"k{i}": i for i in range(8)}

        def full_disk(batches, durable=True):
            raise sqlite3.OperationalError("database or disk is full")
        monkeypatch.setattr(docs.store, "save_many", full_disk)
        failed = []

        async def refused(i):
            with pytest.raises(DocError, match="disk is full"):
                await docs.write_shared(replica, lambda tx: tx.set(["lost"], i))
            failed.append(i)

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(refused, i)
        assert sorted(failed) == [0, 1, 2] and "lost" not in replica.doc.get()  # each caller told; none kept
