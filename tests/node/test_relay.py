"""Relayed connections on loopback: reservations, limits, and every RPC kind over a circuit."""

import dataclasses

import pytest
import trio

import meshd
from meshd import Config


def relay_config(**limits) -> Config:
    config = Config()
    config.relay.enabled = True
    for key, value in limits.items():
        setattr(config.relay, key, value)
    return config


async def echo(arg, ctx):
    return {"arg": arg, "path": ctx.info["path"], "from": str(ctx.peer)}


async def count(n, ctx):
    for i in range(n):
        yield i


async def total(items, ctx):
    return sum([x async for x in items])


async def chat(channel, ctx):
    async for item in channel:
        await channel.send(item + 1)


async def meet_at_relay(r, n, x):
    """N holds a reservation at relay R; X is connected to R."""
    await n.connect(r.address)
    await n.service("nat").relay.reserve(r.peer_id)
    await x.connect(r.address)


def serve_all(node):
    node.rpc.register("echo", echo)
    node.rpc.register("count", count)
    node.rpc.register("total", total, kind="client_stream")
    node.rpc.register("chat", chat, kind="bidi")


async def test_every_rpc_kind_works_both_ways_over_a_relay(tmp_path):
    async with meshd.open_node(tmp_path / "r", listen="127.0.0.1:0", config=relay_config()) as r, \
            meshd.open_node(tmp_path / "n", listen="127.0.0.1:0") as n, \
            meshd.open_node(tmp_path / "x", listen="127.0.0.1:0") as x:
        serve_all(n)
        serve_all(x)
        await n.connect(r.address)
        limits = await n.service("nat").relay.reserve(r.peer_id)
        assert limits["max_circuits"] == 16
        await x.connect(r.address)
        with trio.fail_after(20):
            conn = await x.service("nat").relay.dial_via(r.peer_id, n.peer_id)
            await n.wait_connected(x.peer_id)
        assert conn.path == "relayed" and conn.peer_id == n.peer_id
        assert x.peers()[-1]["path"] in ("relayed", "direct")
        with trio.fail_after(20):
            reply = await x.rpc.call(n.peer_id, "echo", "hi")
            assert reply == {"arg": "hi", "path": "relayed", "from": str(x.peer_id)}
            assert [i async for i in x.rpc.stream(n.peer_id, "count", 5)] == [0, 1, 2, 3, 4]
            assert await x.rpc.client_stream(n.peer_id, "total", range(100)) == 4950
            async with x.rpc.bidi(n.peer_id, "chat") as channel:
                await channel.send(41)
                assert await channel.receive() == 42
            # and back: N calls X over the same relayed connection
            assert (await n.rpc.call(x.peer_id, "echo", 1))["path"] == "relayed"
            big = await x.rpc.call(n.peer_id, "echo", b"z" * (3 << 20))
            assert big["arg"] == b"z" * (3 << 20)


async def test_no_reservation_no_relay_and_relaying_off_are_clear_errors(tmp_path):
    async with meshd.open_node(tmp_path / "r", listen="127.0.0.1:0", config=relay_config()) as r, \
            meshd.open_node(tmp_path / "plain", listen="127.0.0.1:0") as plain, \
            meshd.open_node(tmp_path / "n", listen="127.0.0.1:0") as n, \
            meshd.open_node(tmp_path / "x", listen="127.0.0.1:0") as x:
        await n.connect(plain.address)
        with pytest.raises(meshd.PermissionDenied, match="does not relay"):
            await n.service("nat").relay.reserve(plain.peer_id)
        await n.connect(r.address)
        await x.connect(r.address)
        with trio.fail_after(20), pytest.raises(meshd.Unavailable, match="no reservation"):
            await x.service("nat").relay.dial_via(r.peer_id, n.peer_id)
        await n.service("nat").relay.reserve(r.peer_id)
        with trio.fail_after(20):
            conn = await x.service("nat").relay.dial_via(r.peer_id, n.peer_id)
        assert conn.path == "relayed"


async def test_a_circuit_ends_at_its_byte_limit(tmp_path):
    config = relay_config(circuit_bytes=256 << 10)
    async with meshd.open_node(tmp_path / "r", listen="127.0.0.1:0", config=config) as r, \
            meshd.open_node(tmp_path / "n", listen="127.0.0.1:0") as n, \
            meshd.open_node(tmp_path / "x", listen="127.0.0.1:0") as x:
        serve_all(n)
        await meet_at_relay(r, n, x)
        with trio.fail_after(20):
            conn = await x.service("nat").relay.dial_via(r.peer_id, n.peer_id)
            assert (await x.rpc.call(n.peer_id, "echo", "small"))["arg"] == "small"
            with pytest.raises(meshd.RpcError):
                await x.rpc.call(n.peer_id, "echo", b"z" * (1 << 20), timeout=10)
            await conn.terminated.wait()  # the relay cut the circuit; the connection died with it
            assert r.service("nat").relay.status()["serving"][str(n.peer_id)]["circuits"] == 0
            # and the peers reconnect through a new circuit
            await x.service("nat").relay.dial_via(r.peer_id, n.peer_id)
            assert (await x.rpc.call(n.peer_id, "echo", "again"))["arg"] == "again"


async def test_the_relay_paces_what_its_circuits_carry_to_its_rate(tmp_path):
    """A 256 KiB echo crosses the circuit twice (512 KiB and some): at 128 KiB/s, with one
    second's worth let through at once, it cannot take less than about 3 s (unpaced it
    takes a tenth of that here)."""
    rate = 128 << 10
    config = relay_config(rate=rate)
    config.nat.hole_punching = False  # on loopback it would succeed and replace the circuit
    async with meshd.open_node(tmp_path / "r", listen="127.0.0.1:0", config=config) as r, \
            meshd.open_node(tmp_path / "n", listen="127.0.0.1:0", config=config) as n, \
            meshd.open_node(tmp_path / "x", listen="127.0.0.1:0", config=config) as x:
        serve_all(n)
        await meet_at_relay(r, n, x)
        with trio.fail_after(30):
            await x.service("nat").relay.dial_via(r.peer_id, n.peer_id)
            start = trio.current_time()
            reply = await x.rpc.call(n.peer_id, "echo", b"z" * (256 << 10), timeout=20)
            took = trio.current_time() - start
        assert reply["arg"] == b"z" * (256 << 10) and reply["path"] == "relayed"
        assert took >= (2 * (256 << 10) - rate) / rate, took


async def test_a_circuit_ends_at_its_time_limit(tmp_path):
    config = relay_config(circuit_seconds=0.5)
    async with meshd.open_node(tmp_path / "r", listen="127.0.0.1:0", config=config) as r, \
            meshd.open_node(tmp_path / "n", listen="127.0.0.1:0") as n, \
            meshd.open_node(tmp_path / "x", listen="127.0.0.1:0") as x:
        await meet_at_relay(r, n, x)
        with trio.fail_after(20):
            start = trio.current_time()  # the circuit starts during the dial (which took 0.2 s once, loaded)
            conn = await x.service("nat").relay.dial_via(r.peer_id, n.peer_id)
            await conn.terminated.wait()
        assert 0.45 < trio.current_time() - start < 10


async def test_the_control_socket_reserves_and_connects_through_a_relay(tmp_path):
    no_punching = Config()
    no_punching.nat.hole_punching = False  # on loopback it would succeed and replace the circuit
    async with meshd.open_node(tmp_path / "r", listen="127.0.0.1:0", config=relay_config()) as r, \
            meshd.open_node(tmp_path / "n", listen="127.0.0.1:0") as n, \
            meshd.open_node(tmp_path / "x", listen="127.0.0.1:0", config=no_punching):
        async with meshd.connect(tmp_path / "n") as nctl, meshd.connect(tmp_path / "x") as xctl:
            await nctl.connect(str(r.address))
            status = await nctl.relay(reserve=str(r.peer_id))
            assert str(r.peer_id) in status["reserved_at"]
            await xctl.connect(str(r.address))
            with trio.fail_after(20):
                assert await xctl.connect(str(n.peer_id), via=str(r.peer_id)) == str(n.peer_id)
                assert await xctl.call(n.peer_id, "ping", "relayed") == "relayed"
            relayed = [p for p in await xctl.peers() if p["peer_id"] == str(n.peer_id)]
            assert relayed and relayed[0]["path"] == "relayed"
        assert r.service("nat").relay.status()["serving"][str(n.peer_id)]["circuits"] == 1


async def test_a_relayed_peer_that_is_reachable_gets_a_punched_direct_path(tmp_path):
    # On loopback nothing filters, so the punch must succeed; the NAT lab tests the hard cases.
    async with meshd.open_node(tmp_path / "r", listen="127.0.0.1:0", config=relay_config()) as r, \
            meshd.open_node(tmp_path / "s", listen="127.0.0.1:0") as s, \
            meshd.open_node(tmp_path / "n", listen="127.0.0.1:0") as n, \
            meshd.open_node(tmp_path / "x", listen="127.0.0.1:0") as x:
        serve_all(n)
        for node in (n, x):
            await node.connect(r.address)
            await node.connect(s.address)  # a second STUN server for discovery
        await n.service("nat").relay.reserve(r.peer_id)
        await n.service("nat").stun.discover(n.service("nat").stun_servers())
        with trio.fail_after(30):
            relayed = await x.service("nat").relay.dial_via(r.peer_id, n.peer_id)
            assert relayed.path == "relayed"
            direct = await x.service("nat").puncher.punch(n.peer_id)
        assert direct is not None and direct.path == "punched"
        assert x._conns[n.peer_id] is direct
        with trio.fail_after(10):
            assert (await x.rpc.call(n.peer_id, "echo", "direct"))["path"] == "punched"


async def test_punching_requests_are_refused_off_a_relay(tmp_path):
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0") as a, \
            meshd.open_node(tmp_path / "b", listen="127.0.0.1:0") as b:
        await b.connect(a.address)
        for method, arg in (("punch.exchange", {"addrs": ["192.0.2.1:9"]}),
                            ("punch.probe", {"ip": "192.0.2.1"}),
                            ("punch.open_ports", {"addr": "192.0.2.1:9"})):
            with pytest.raises(meshd.InvalidArgument, match="over a relayed connection"):
                await b.rpc.call(a.peer_id, method, arg)


async def test_advertised_relays_are_used_to_reach_a_peer_by_id(tmp_path):
    async with meshd.open_node(tmp_path / "r", listen="127.0.0.1:0", config=relay_config()) as r, \
            meshd.open_node(tmp_path / "n", listen="127.0.0.1:0") as n, \
            meshd.open_node(tmp_path / "x", listen="127.0.0.1:0") as x:
        serve_all(n)
        await meet_at_relay(r, n, x)
        info = await x.identify(r.peer_id)
        assert info["relays"] == []  # the relay itself holds no reservation elsewhere
        await x.connect(n.address)
        advertised = (await x.identify(n.peer_id))["relays"]
        assert advertised == [str(r.peer_id)]
        x.disconnect(n.peer_id)
        # a node that knows only N's PeerId and advertised relay (no address, no bootstrap)
        async with meshd.open_node(tmp_path / "y", listen="127.0.0.1:0") as y:
            await y.connect(r.address)
            y.peerstore.set_relays(n.peer_id, advertised)
            with trio.fail_after(20):
                reply = await y.rpc.call(n.peer_id, "echo", "via advertised relay")
            assert reply["arg"] == "via advertised relay"


async def test_a_refused_reservation_at_a_bootstrap_relay_is_asked_for_again(tmp_path, monkeypatch):
    from meshd.services.nat import service as nat_service

    monkeypatch.setattr(nat_service, "RESERVE_RETRY", 0.1)
    config = relay_config()
    config.relay.enabled = False  # not relaying yet: the first request is refused
    async with meshd.open_node(tmp_path / "r", listen="127.0.0.1:0", config=config) as r:
        reservations = r.service("nat").relay.reservations
        asked, reserve = [], reservations.reserve
        reservations.reserve = lambda peer, now: asked.append(peer) or reserve(peer, now)
        async with meshd.open_node(tmp_path / "n", listen="127.0.0.1:0", bootstrap=[str(r.address)]) as n:
            held = n.service("nat").relay.reserved_at
            await n.connect(r.address)
            with trio.fail_after(10):
                while not asked:
                    await trio.sleep(0.02)
                assert not held.holds(r.peer_id)  # refused
                reservations.limits = dataclasses.replace(reservations.limits, enabled=True)  # relaying on
                while not held.holds(r.peer_id):
                    await trio.sleep(0.02)
            assert len(asked) >= 2, asked
