"""Ten real ``meshd`` processes edit one replicated document while two of them
are SIGKILLed mid-write and restarted on their data dirs.

Every write adds a unique element to a set and increments a counter in one
change.  At the end every acknowledged element is on every node, all nodes
hold the same value, and the counter equals the number of elements (a change
is applied whole or not at all).  ``meshctl crdt`` is exercised on the way.
"""

from __future__ import annotations

import json

import trio

import meshd
from test_daemons import daemons, one_line_error  # noqa: F401  (daemons: the fixture)
from test_dht_daemons import each, start

NODES = 10
VICTIMS = (3, 7)
WRITES = 12  # per node before the kills; victims are killed after half of theirs
CONFIG = {
    "transport": {"idle_timeout": 3.0, "keepalive_interval": 0.5, "handshake_timeout": 2.0},
    "dht": {"request_timeout": 2.0},
    "crdt": {"sync_interval": 1.0, "discover_interval": 2.0},
}


async def write_elements(daemon, ref: str, name: str, numbers: range, acked: set[str]) -> None:
    """Write ``name/i`` for each i, one change each; record those acknowledged."""
    async with meshd.connect(daemon.data_dir) as client:
        doc = await client.document(ref)
        for i in numbers:
            element = f"{name}/{i}"
            await doc.write([["add", ["acked"], element], ["inc", ["count"], 1]])
            acked.add(element)


async def write_until_killed(daemon, ref: str, name: str, acked: set[str]) -> None:
    """Half the writes, then a SIGKILL while the next write is in flight."""
    await write_elements(daemon, ref, name, range(WRITES // 2), acked)
    async with meshd.connect(daemon.data_dir) as client:
        doc = await client.document(ref)
        async with trio.open_nursery() as nursery:
            async def in_flight() -> None:
                try:
                    await doc.write([["add", ["acked"], f"{name}/in-flight"], ["inc", ["count"], 1]])
                except (meshd.RpcError, meshd.DaemonNotRunning, OSError):
                    return  # never acknowledged: it may or may not survive
                acked.add(f"{name}/in-flight")
            nursery.start_soon(in_flight)
            await trio.sleep(0)  # let the write start
            daemon.kill()


async def has_all(daemon, ref: str, acked: set[str]) -> None:
    """Wait on the node's change stream until every acknowledged element is there."""
    async with meshd.connect(daemon.data_dir) as client:
        doc = await client.document(ref)
        async with doc.changes() as events:
            while not acked <= set((await doc.get("acked")) or []):
                await events.__anext__()


async def test_ten_daemons_keep_every_acknowledged_write_through_sigkills(daemons):  # noqa: F811
    with trio.fail_after(150):
        [owner] = await start(daemons, ["c00"], config=CONFIG)
        names = [f"c{i:02}" for i in range(1, NODES)]
        nodes = [owner] + await start(daemons, names, config=CONFIG, bootstrap=[str(owner.address)])
        ref = f"{owner.peer_id}/run"

        created = owner.meshctl("crdt", "create", "run")
        assert created["doc"] == ref and created["writable"]
        async with meshd.connect(owner.data_dir) as client:
            doc = await client.document("run")
            await doc.write([["grant", node.peer_id, "writer"] for node in nodes[1:]])
        await each(nodes[1:], lambda client: client.document(ref))
        infos = await each(nodes, lambda client: client.request("crdt.info", {"doc": ref}))
        assert all(info["writable"] and info["changes"] == 1 for info in infos)

        acked: set[str] = set()
        async with trio.open_nursery() as nursery:
            for i, node in enumerate(nodes):
                if i in VICTIMS:
                    nursery.start_soon(write_until_killed, node, ref, f"n{i}", acked)
                else:
                    nursery.start_soon(write_elements, node, ref, f"n{i}", range(WRITES), acked)
        restarted = await start(daemons, [names[i - 1] for i in VICTIMS], config=CONFIG,
                                bootstrap=[str(owner.address)])
        async with trio.open_nursery() as nursery:
            for i, node in zip(VICTIMS, restarted):
                nursery.start_soon(write_elements, node, ref, f"n{i}", range(WRITES // 2, WRITES), acked)
        nodes = [restarted[VICTIMS.index(i)] if i in VICTIMS else node for i, node in enumerate(nodes)]
        assert len(acked) >= NODES * WRITES

        async with trio.open_nursery() as nursery:
            for node in nodes:
                nursery.start_soon(has_all, node, ref, acked)
        # Unacknowledged in-flight writes may still travel: one explicit round of
        # syncs with every replica brings all nodes to the same set of changes.
        for node in nodes:
            node.meshctl("crdt", "sync", ref)
        values = await each(nodes, lambda client: client.request("crdt.get", {"doc": ref}))
        assert all(v == values[0] for v in values)
        value = values[0]["value"]
        assert acked <= set(value["acked"])
        assert value["count"] == len(value["acked"])  # each change applied whole

        # meshctl on a restarted node: set, inc, add, rm, get, watch, ls, a refused write.
        node = nodes[VICTIMS[0]]
        node.meshctl("crdt", "set", ref, "model/current", '{"name": "gpt", "version": 7}')
        node.meshctl("crdt", "inc", ref, "steps", "5")
        node.meshctl("crdt", "add", ref, "tags", "fast")
        node.meshctl("crdt", "rm", ref, "acked", f"n{VICTIMS[0]}/0")
        assert node.meshctl("crdt", "get", ref, "model/current") == {"name": "gpt", "version": 7}
        assert node.meshctl("crdt", "get", ref, "steps") == 5
        human = node.meshctl_raw("crdt", "get", ref, "model/current").stdout
        assert json.loads(human) == {"name": "gpt", "version": 7}  # what `crdt set` takes, not a repr
        assert [d["doc"] for d in node.meshctl("crdt", "ls")] == [ref]
        async with meshd.connect(owner.data_dir) as client:
            doc = await client.document(ref)
            async with doc.changes() as events:
                node.meshctl("crdt", "inc", ref, "steps", "-2")
                with trio.fail_after(30):  # the node's earlier writes may reach the owner first
                    async for event in events:
                        if event["ops"][0].get("total") == 3:  # the author's running total: 5 - 2
                            break
        assert event["author"] == node.peer_id and event["ops"][0]["path"] == ["steps"]
        [stranger] = await start(daemons, ["stranger"], config=CONFIG, bootstrap=[str(owner.address)])
        refused = stranger.meshctl_raw("crdt", "set", ref, "x", "1")
        assert "may not write" in one_line_error(refused)
