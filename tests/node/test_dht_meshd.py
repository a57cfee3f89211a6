"""The DHT inside meshd nodes (in-process, real QUIC on loopback): what a
hostile peer can and cannot do over RPC, roles, and finding peers by PeerId.

Raw ``dht.*`` calls stand in for a misbehaving peer: they go through the
same authenticated connection a real DHT node would use.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import AsyncExitStack

import pytest
import trio

import meshd
from dht.ids import Contact
from dht.network import ADD_PROVIDER, GET_PROVIDERS, PING, PUT_VALUE
from dht.records import MAX_VALUE, owned_key, sign_record
from meshd import Config, ConfigError
from meshd.services.dht.relays import decode_relays, relays_key
from meshd.wire import pack

KEY = b"/open/greeting"


def config(**dht) -> Config:
    cfg = Config()
    cfg.transport.handshake_timeout = 3.0
    for name, value in dht.items():
        setattr(cfg.dht, name, value)
    return cfg


def signed(node: meshd.Node, key: bytes, value: bytes, **fields) -> dict:
    """A record of ``value`` under ``key`` signed by ``node``, as it travels."""
    record = sign_record(key, value, public_key=node.peer_id.key, sign=node.identity.sign,
                         seq=1, expires=int(time.time()) + 600)
    return dataclasses.replace(record, **fields).to_wire()


async def open_nodes(stack: AsyncExitStack, tmp_path, names: str, **kwargs) -> list[meshd.Node]:
    return [await stack.enter_async_context(
                meshd.open_node(tmp_path / name, listen="127.0.0.1:0", **kwargs))
            for name in names]


async def wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    """Poll ``predicate`` (cheap, in-process) until true; fail after ``timeout`` s."""
    with trio.move_on_after(timeout):
        while not predicate():
            await trio.sleep(0.02)
        return
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


async def test_forged_oversized_and_foreign_records_are_refused(tmp_path):
    async with AsyncExitStack() as stack:
        a, b = await open_nodes(stack, tmp_path, "ab")
        await b.connect(a.address)

        async def put(*records: dict) -> list:
            reply = await b.rpc.call(a.peer_id, PUT_VALUE, {"records": list(records)}, timeout=10)
            return reply["stored"]

        honest = signed(b, KEY, b"hello")
        forged = {**honest, "v": b"changed after signing"}
        oversized = signed(b, b"/open/big", b"x")
        oversized["v"] = bytes(MAX_VALUE + 1)
        not_mine = signed(b, owned_key(a.peer_id.key, b"name"), b"B writes A's key")
        unknown = signed(b, b"/secret/x", b"no such namespace")
        results = await put(forged, oversized, not_mine, unknown)
        assert "signature does not verify" in results[0]
        assert f"0-{MAX_VALUE} bytes" in results[1]
        assert "only the public key named" in results[2]
        assert "unknown namespace" in results[3]
        assert len(a.service("dht").node.records) == 0

        assert await put(honest) == [None]
        assert (await a.service("dht").node.get(KEY)).value == b"hello"

        with pytest.raises(meshd.InvalidArgument, match="must be a map"):
            await b.rpc.call(a.peer_id, PUT_VALUE, ["not", "a", "map"], timeout=10)
        with pytest.raises(meshd.InvalidArgument, match="records"):
            await b.rpc.call(a.peer_id, PUT_VALUE, {"records": [{}] * 100}, timeout=10)


async def test_add_provider_is_stored_under_the_authenticated_sender(tmp_path):
    async with AsyncExitStack() as stack:
        a, b, c = await open_nodes(stack, tmp_path, "abc")
        for node in (b, c):
            await node.connect(a.address)
        # B names C as the provider every way a message could.
        claim = {"keys": [b"content-id"], "ttl": 600, "pk": c.peer_id.key,
                 "a": [str(c.listen_address)], "from": [str(c.listen_address)]}
        assert (await b.rpc.call(a.peer_id, ADD_PROVIDER, claim, timeout=10))["added"] == 1

        reply = await c.rpc.call(a.peer_id, GET_PROVIDERS, {"keys": [b"content-id"]}, timeout=10)
        [[provider]] = reply["providers"]
        assert provider["pk"] == b.peer_id.key
        assert a.service("dht").node.providers.stats() == {"keys": 1, "providers": 1}


async def test_add_provider_flood_is_refused_while_others_are_served(tmp_path):
    async with AsyncExitStack() as stack:
        a, b, c = await open_nodes(stack, tmp_path, "abc")
        for node in (b, c):
            await node.connect(a.address)
        burst = a.service("dht").node.config.peer_burst
        batch = [b"key-%d" % i for i in range(16)]
        accepted = 0
        with pytest.raises((meshd.InvalidArgument, meshd.ResourceExhausted), match="too many"):
            for _ in range(burst // len(batch) + 10):  # at most ~10 batches' worth of refill
                msg = {"keys": batch, "ttl": 600, "a": [str(b.listen_address)]}
                accepted += (await b.rpc.call(a.peer_id, ADD_PROVIDER, msg, timeout=10))["added"]
        assert burst - len(batch) < accepted <= burst + 10 * len(batch)

        # Others, and B's other calls, are still served.
        msg = {"keys": [b"c-key"], "ttl": 600, "a": [str(c.listen_address)]}
        assert (await c.rpc.call(a.peer_id, ADD_PROVIDER, msg, timeout=10))["added"] == 1
        assert (await c.rpc.call(a.peer_id, PING, {}, timeout=10))["server"] is True
        assert await b.rpc.call(a.peer_id, "ping", "still here", timeout=10) == "still here"


async def test_client_mode_is_served_but_never_routed_to(tmp_path):
    async with AsyncExitStack() as stack:
        [a] = await open_nodes(stack, tmp_path, "a")
        [b] = await open_nodes(stack, tmp_path, "b", bootstrap=[str(a.address)],
                               config=config(mode="client"))
        [c] = await open_nodes(stack, tmp_path, "c", bootstrap=[str(a.address)])
        await wait_for(lambda: len(b.service("dht").node.table) >= 1 and len(c.service("dht").node.table) >= 1, "B and C to join")
        assert b.service("dht").node.routing_info()["mode"] == "client"
        assert await b.service("dht").node.put(KEY, b"from a client") >= 1
        assert (await c.service("dht").node.get(KEY)).value == b"from a client"
        for server in (a, c):
            assert Contact(b.peer_id.key) not in server.service("dht").node.table


async def test_auto_mode_follows_the_autonat_verdict(tmp_path):
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0") as a:
        assert a.config.dht.mode == "auto" and a.service("dht").node.server_mode
        for status, server in (("private", False), ("public", True)):
            a.service("nat").autonat.status = status  # what AutoNat.check does on a new verdict
            a.service("nat").autonat.changed.unpark_all()
            await wait_for(lambda: a.service("dht").node.server_mode == server, f"the DHT to follow {status!r}")


def test_dht_mode_is_checked_when_the_config_is_read():
    cfg = Config()
    cfg.update({"dht": {"mode": "server", "k": 8}})
    assert cfg.dht.dht_config().k == 8
    with pytest.raises(ConfigError, match="dht.mode must be one of auto, server, client"):
        cfg.update({"dht": {"mode": "relay"}})


async def test_a_peer_known_only_to_the_dht_is_reached_by_peer_id(tmp_path):
    async with AsyncExitStack() as stack:
        [a] = await open_nodes(stack, tmp_path, "a")
        [c] = await open_nodes(stack, tmp_path, "c", bootstrap=[str(a.address)])
        await wait_for(lambda: Contact(c.peer_id.key) in a.service("dht").node.table, "A to route to C")
        # D has no bootstrap peers and has never heard of C: only a routing
        # table entry for A, as a saved table would give it after a restart.
        [d] = await open_nodes(stack, tmp_path, "d", config=config())
        d.service("dht").node.table.update(Contact(a.peer_id.key, (str(a.listen_address),)))
        assert d.peerstore.get(c.peer_id) is None
        with trio.fail_after(15):
            assert await d.rpc.call(c.peer_id, "ping", "found", timeout=10) == "found"
        assert str(c.listen_address) in d.peerstore.get(c.peer_id).addrs


async def test_a_natted_peer_nobody_met_is_reached_through_the_relays_it_published(tmp_path):
    async with AsyncExitStack() as stack:
        relay = config()
        relay.relay.enabled = True
        [r] = await open_nodes(stack, tmp_path, "r", config=relay)
        [b] = await open_nodes(stack, tmp_path, "b", bootstrap=[str(r.address)])
        # N: a DHT client (as behind a NAT: in no routing table), holding a reservation at R
        natted = config(mode="client", relays_check=0.05)
        [n] = await open_nodes(stack, tmp_path, "n", bootstrap=[str(r.address)], config=natted)
        # X knows only B, neither N's address nor its relay; a client too, so that N's
        # lookups never meet it
        [x] = await open_nodes(stack, tmp_path, "x", bootstrap=[str(b.address)], config=config(mode="client"))
        assert x.peerstore.get(n.peer_id) is None
        with trio.fail_after(20):
            await x.service("dht").node.joined.wait()  # X's lookups can find others
            while (record := await x.service("dht").node.get(relays_key(n.peer_id))) is None:
                await trio.sleep(0.05)  # N publishes once its own join is done
            assert [str(a) for a in decode_relays(record.value)] == [f"{r.peer_id}@{r.listen_address}"]
            assert await x.rpc.call(n.peer_id, "ping", "through R", timeout=15) == "through R"
        assert r.service("nat").relay.figures()["relay_circuits_opened_total"] == 1


async def test_a_dial_through_a_published_relay_that_refuses_says_so(tmp_path):
    async with AsyncExitStack() as stack:
        [b] = await open_nodes(stack, tmp_path, "b")  # relaying is off here
        [m, x] = await open_nodes(stack, tmp_path, "mx", bootstrap=[str(b.address)], config=config(mode="client"))
        with trio.fail_after(20):
            for node in (m, x):
                await node.service("dht").node.joined.wait()
            # M names B as its relay (as after B stopped relaying)
            assert await m.service("dht").node.put(relays_key(m.peer_id), pack([str(b.address)])) >= 1
            with pytest.raises(meshd.RpcError, match=f"via {b.peer_id.short()} \\(its DHT record\\): "):
                await x.rpc.call(m.peer_id, "ping", "through B", timeout=15)


async def test_wildcard_listener_advertises_where_direct_peers_see_it(tmp_path):
    cfg = config()
    cfg.nat.port_mapping = False  # no NAT-PMP probes of the default gateway from a test
    cfg.nat.lan_discovery = False  # no LAN beacons: another meshd on this LAN would change what it advertises
    async with AsyncExitStack() as stack:
        [a] = await open_nodes(stack, tmp_path, "a")
        b = await stack.enter_async_context(meshd.open_node(tmp_path / "b", listen="0.0.0.0:0", config=cfg))
        assert b.advertised_addresses() == []  # nothing known yet
        await b.connect(a.address)
        port = b.listen_address.port
        await wait_for(lambda: b.advertised_addresses() == [f"127.0.0.1:{port}"], "the observed address")
