"""One DhtNode: what it refuses from peers, and what survives a restart."""

import dataclasses
import time

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dht.ids import Contact, key_id
from dht.network import ADD_PROVIDER, FIND_NODE, GET_VALUE, PUT_VALUE, Refused
from dht.node import DhtConfig, DhtNode
from dht.records import MAX_VALUE
from dht.simnet import SimNetwork, fill_tables, make_nodes
from dht.storage import Database
from test_dht_records import Author


def fresh(author: Author, key: bytes, value: bytes):
    """A record that is valid now (the shared helper defaults to a fixed clock)."""
    return author.record(key, value, seq=1, expires=int(time.time()) + 3600)


@pytest.fixture
def node():
    net = SimNetwork()
    nodes = make_nodes(net, 50, seed=1)
    fill_tables(nodes)
    return nodes[0]


@pytest.mark.parametrize("method,msg,reason", [
    ("dht.nope", {}, "unknown DHT method"),
    (FIND_NODE, [], "must be a map"),
    (FIND_NODE, {"ids": [b"short"]}, "32 bytes"),
    (FIND_NODE, {"ids": [bytes(32)] * 17}, "1 to 16"),
    (GET_VALUE, {"keys": [b""]}, "1 to 256 bytes"),
    (GET_VALUE, {"keys": "not a list"}, "list"),
    (PUT_VALUE, {"records": []}, "1 to 16"),
    (ADD_PROVIDER, {"keys": [b"k"], "ttl": -1}, "positive"),
    (ADD_PROVIDER, {"keys": [b"k"], "ttl": 60, "a": ["x"] * 20}, "at most 8"),
    (FIND_NODE, {"ids": [bytes(32)], "from": "1.2.3.4:5"}, "'from'"),
])
async def test_malformed_requests_are_refused_with_the_reason(node, method, msg, reason):
    with pytest.raises(Refused, match=reason):
        await node.handle(Author().public_key, method, msg)
    assert (await node.handle(Author().public_key, FIND_NODE, {"ids": [bytes(32)]}))["nodes"]  # still serving


async def test_bad_records_are_refused_one_by_one(node):
    author = Author()
    good = fresh(author, b"/open/good", b"v")
    forged = dataclasses.replace(fresh(author, b"/open/forged", b"v"), value=b"changed")
    big = fresh(author, b"/open/big", b"x" * MAX_VALUE)
    too_big = good.to_wire() | {"k": b"/open/too-big", "v": b"x" * (MAX_VALUE + 1)}
    not_owner = fresh(author, b"/owned/" + Author().public_key.hex().encode() + b"/name", b"v")
    unknown = fresh(author, b"/elsewhere/x", b"v")
    reply = await node.handle(author.public_key, PUT_VALUE, {"records": [
        good.to_wire(), forged.to_wire(), big.to_wire(), too_big, not_owner.to_wire(), unknown.to_wire()]})
    ok, bad_sig, ok_big, oversize, wrong_owner, bad_ns = reply["stored"]
    assert ok is None and ok_big is None
    assert "signature" in bad_sig
    assert "value" in oversize
    assert "may write it" in wrong_owner
    assert "namespace" in bad_ns
    assert node.records.get(b"/open/good", node.wall()).value == b"v"
    assert node.records.get(b"/open/forged", node.wall()) is None


async def test_a_provider_is_the_authenticated_sender_whatever_the_message_says(node):
    sender, claimed = Author(), Author()
    await node.handle(sender.public_key, ADD_PROVIDER,
                      {"keys": [b"shard"], "ttl": 60.0, "a": ["10.0.0.1:4100"], "pk": claimed.public_key})
    [(provider, _)] = node.providers.get(b"shard", node.wall())
    assert provider.public_key == sender.public_key and provider.addrs == ("10.0.0.1:4100",)


async def test_routing_table_records_and_provided_keys_survive_a_restart(tmp_path):
    net = SimNetwork()
    peers = make_nodes(net, 30, seed=2)
    fill_tables(peers)
    key = Ed25519PrivateKey.generate()
    pk = key.public_key().public_bytes_raw()

    def open_node(db):
        node = DhtNode(net.endpoint(pk), pk, key.sign, addrs=lambda: ["sim:me"], db=db,
                       config=DhtConfig(save_delay=0.0))
        net.nodes[pk] = node
        return node

    db = Database(tmp_path / "dht.sqlite")
    first = open_node(db)
    async with trio.open_nursery() as nursery:
        await nursery.start(first.run)
        assert await first.bootstrap([peers[0].own_contact()]) >= 10
        assert await first.put(b"/open/kept", b"value") > 0
        assert await first.provide(b"shard-1") > 0
        nursery.cancel_scope.cancel()  # run() saves the table on the way out
    known = {c.public_key for c in first.table.contacts()}
    db.close()

    db = Database(tmp_path / "dht.sqlite")
    second = open_node(db)
    assert {c.public_key for c in second.table.contacts()} == known
    assert second.records.get(b"/open/kept", second.wall()).value == b"value"
    assert [c.public_key for c, _ in second.providers.get(b"shard-1", second.wall())] == [pk]
    async with trio.open_nursery() as nursery:
        await nursery.start(second.run)
        assert b"shard-1" in second._provided  # republishing resumes
        found = await second.find_node(key_id(b"anything"))
        assert len(found) == 20
        nursery.cancel_scope.cancel()
    db.close()
    assert all(isinstance(c, Contact) for c in found)
