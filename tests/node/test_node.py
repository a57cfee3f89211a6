"""Nodes in one process: RPC both ways, identify, peer store, duplicates, limits."""

import pytest
import trio

import meshd
from meshd import Config


async def echo(arg, ctx):
    return {"echo": arg, "from": str(ctx.peer)}


async def test_a_node_still_says_where_it_listened_once_its_socket_is_closed(tmp_path):
    """A DHT lookup that ends while the node shuts down builds its message from the listen
    address after the socket is closed; that failed the node's exit with OSError(9)."""
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0") as node:
        address = node.listen_address
    assert node.endpoint._sock.fileno() == -1  # closed
    assert node.listen_address == address and node.advertised_addresses() == [str(address)]


async def test_rpc_both_ways_and_identify(tmp_path):
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0") as a:
        async with meshd.open_node(tmp_path / "b", listen="127.0.0.1:0", bootstrap=[str(a.address)]) as b:
            a.rpc.register("echo", echo)
            b.rpc.register("echo", echo)
            with trio.fail_after(10):
                await b.wait_connected(a.peer_id)
                await a.wait_connected(b.peer_id)
            assert await b.rpc.call(a.peer_id, "echo", 1) == {"echo": 1, "from": str(b.peer_id)}
            assert await a.rpc.call(str(b.peer_id), "echo", 2) == {"echo": 2, "from": str(a.peer_id)}
            info = await b.identify(a.peer_id)
            assert info["peer_id"] == str(a.peer_id)
            assert info["observed"] == str(b.listen_address)
            assert {"echo", "identify", "ping"} <= set(info["services"])
            assert await b.ping(a.peer_id) < 1.0
            [row] = b.peers()
            assert row["peer_id"] == str(a.peer_id) and row["direction"] == "out"
            assert row["datagram"] == 16000  # loopback: large datagrams from the start


async def test_peer_store_survives_a_restart(tmp_path):
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0") as a:
        for _ in range(2):
            async with meshd.open_node(tmp_path / "b", listen="127.0.0.1:0") as b:
                await b.connect(a.address)
                await b.ping(a.peer_id)
        async with meshd.open_node(tmp_path / "b", listen="127.0.0.1:0") as b:
            record = b.peerstore.get(a.peer_id)
            assert record is not None and str(a.listen_address) in record.addrs
            assert record.rtt_ms is not None
            # known address: a call by PeerId alone dials it
            assert await b.rpc.call(a.peer_id, "ping", "hi") == "hi"


async def test_idle_connections_close_but_bootstrap_and_busy_ones_stay(tmp_path):
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0") as a, \
            meshd.open_node(tmp_path / "b", listen="127.0.0.1:0", bootstrap=[str(a.address)]) as b, \
            meshd.open_node(tmp_path / "c", listen="127.0.0.1:0") as c, \
            meshd.open_node(tmp_path / "d", listen="127.0.0.1:0") as d:
        started, release = trio.Event(), trio.Event()

        async def hold(arg, ctx):
            started.set()
            await release.wait()
            return "done"

        b.rpc.register("hold", hold)
        with trio.fail_after(10):
            await b.wait_connected(a.peer_id)
            await c.connect(b.address)
            await d.connect(b.address)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(d.rpc.call, b.peer_id, "hold", None)
                await started.wait()
                while c.peer_id in b.connected():  # identify may still be running on it
                    await b.live(c.peer_id).wait_idle()
                    closed = b.close_idle(older_than=0)
                    assert a.peer_id not in closed and d.peer_id not in closed
                assert {a.peer_id, d.peer_id} <= set(b.connected())  # the bootstrap peer, the busy one
                release.set()
        assert b.close_idle(older_than=3600) == []  # nothing has been idle that long


async def _cancel_when_terminated(conn, scope: trio.CancelScope) -> None:
    await conn.terminated.wait()
    scope.cancel()


async def test_simultaneous_dials_settle_on_one_shared_connection(tmp_path):
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0") as a, \
            meshd.open_node(tmp_path / "b", listen="127.0.0.1:0") as b:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.connect, b.address)
            nursery.start_soon(b.connect, a.address)
        with trio.fail_after(10):
            await a.wait_connected(b.peer_id)
            await b.wait_connected(a.peer_id)
            own_a, own_b = a.live(b.peer_id), b.live(a.peer_id)
            if own_a.dialed and own_b.dialed:  # each dial returned before the other's handshake ended
                async with trio.open_nursery() as nursery:  # the one both sides drop is closed by its dialer
                    for conn in (own_a, own_b):
                        nursery.start_soon(_cancel_when_terminated, conn, nursery.cancel_scope)
        conn_a, conn_b = a.live(b.peer_id), b.live(a.peer_id)
        assert conn_a.dialed != conn_b.dialed  # both kept the same connection
        assert conn_a.close_reason is None and conn_b.close_reason is None
        assert await a.rpc.call(b.peer_id, "ping", 1) == 1
        assert await b.rpc.call(a.peer_id, "ping", 2) == 2


async def test_connection_limit_refuses_with_a_reason(tmp_path):
    config = Config()
    config.transport.max_connections = 1
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0", config=config) as a, \
            meshd.open_node(tmp_path / "b", listen="127.0.0.1:0") as b, \
            meshd.open_node(tmp_path / "c", listen="127.0.0.1:0") as c:
        await b.connect(a.address)
        with pytest.raises(meshd.Unavailable, match="refused the connection: too many connections"):
            await c.connect(a.address)
        assert a.endpoint.stats["refused"] == 1
        assert await b.rpc.call(a.peer_id, "ping", 1) == 1


async def test_a_crowded_address_is_refused_and_other_addresses_still_get_in(tmp_path):
    """``max_per_address`` connections from one IP address, then refusals; loopback counts only
    with ``limit_loopback`` (every node here is on 127.0.0.1, so a second address is ::1)."""
    config = Config()
    config.transport.max_per_address, config.transport.limit_loopback = 1, True
    async with meshd.open_node(tmp_path / "a", listen="[::]:0", config=config) as a, \
            meshd.open_node(tmp_path / "b", listen="127.0.0.1:0") as b, \
            meshd.open_node(tmp_path / "c", listen="127.0.0.1:0") as c, \
            meshd.open_node(tmp_path / "d", listen="[::1]:0") as d:
        port = a.address.port
        await b.connect(f"{a.peer_id}@127.0.0.1:{port}")
        with pytest.raises(meshd.Unavailable, match="refused the connection: too many connections from your address"):
            await c.connect(f"{a.peer_id}@127.0.0.1:{port}")
        assert a.endpoint.stats["refused_address"] == 1
        await d.connect(f"{a.peer_id}@[::1]:{port}")  # another address: let in
        assert await b.rpc.call(a.peer_id, "ping", 1) == 1 and await d.rpc.call(a.peer_id, "ping", 2) == 2
    config.transport.limit_loopback = False  # the default: processes of this machine are not counted
    async with meshd.open_node(tmp_path / "e", listen="127.0.0.1:0", config=config) as e, \
            meshd.open_node(tmp_path / "f", listen="127.0.0.1:0") as f, \
            meshd.open_node(tmp_path / "g", listen="127.0.0.1:0") as g:
        await f.connect(e.address)
        await g.connect(e.address)
        assert e.endpoint.stats["refused_address"] == 0


async def test_peers_at_one_address_share_the_bytes_their_calls_may_hold(tmp_path):
    """``rpc.address_held_bytes`` bounds the frames the calls of every peer at one IP address
    hold (fresh identities on one machine share it); loopback, as here, counts with ``limit_loopback``."""
    config = Config()
    config.rpc.address_held_bytes, config.transport.limit_loopback = 1 << 20, True
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0", config=config) as a, \
            meshd.open_node(tmp_path / "b", listen="127.0.0.1:0") as b, \
            meshd.open_node(tmp_path / "c", listen="127.0.0.1:0") as c:
        release, holding = trio.Event(), trio.Event()

        async def hold(arg, ctx):  # keeps its request frame until released
            holding.set()
            await release.wait()
            return len(arg)

        a.rpc.register("hold", hold)
        await b.connect(a.address)
        await c.connect(a.address)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.rpc.call, a.peer_id, "hold", b"x" * (700 << 10))
            await holding.wait()
            with pytest.raises(meshd.ResourceExhausted, match="address"):  # another identity, same address
                await c.rpc.call(a.peer_id, "hold", b"y" * (700 << 10))
            release.set()
        assert await c.rpc.call(a.peer_id, "hold", b"y" * (700 << 10)) == 700 << 10  # given back


async def test_unknown_peer_and_bad_input_are_clear_errors(tmp_path):
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0") as a:
        stranger = meshd.Identity.generate().peer_id
        with pytest.raises(meshd.Unavailable, match="no known address"):
            await a.rpc.call(stranger, "ping")
        with pytest.raises(meshd.InvalidArgument, match="not a PeerId"):
            await a.rpc.call("nonsense", "ping")
        with pytest.raises(meshd.AddressError):
            await a.connect("nonsense")
    with pytest.raises(meshd.AddressError, match="PEERID@HOST:PORT"):
        async with meshd.open_node(tmp_path / "b", listen="127.0.0.1:0", bootstrap=["1.2.3.4:5"]):
            pass


async def test_a_failing_quic_state_machine_ends_its_connection_not_the_node(tmp_path):
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0") as a, \
            meshd.open_node(tmp_path / "b", listen="127.0.0.1:0") as b:
        await b.connect(a.address)
        conn = b.live(a.peer_id)

        def broken():  # what aioquic 1.7.2 raised once in a 20-daemon test
            raise OverflowError("int too large to convert to float")

        conn.quic.get_timer = broken
        conn._timer_scope.cancel()  # wake the timer loop now
        with trio.fail_after(5):
            await conn.terminated.wait()
        assert "internal error" in conn.close_reason
        assert await b.rpc.call(a.peer_id, "ping", "still here", timeout=5) == "still here"


async def test_an_in_process_node_runs_only_the_services_it_picks(tmp_path):
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0", services=["dht"]) as a, \
            meshd.open_node(tmp_path / "b", listen="127.0.0.1:0") as b:
        assert list(a.services) == ["dht"]
        assert a.off == ("nat", "crdt", "shards", "learning", "experts", "metrics")
        with pytest.raises(meshd.ServiceOff, match="the crdt service is off"):
            a.service("crdt")
        assert list(b.services) == list(meshd.SERVICES)  # every service by default, in start order
        await b.connect(a.address)
        # The core works without them; a peer asking for a missing service gets UNKNOWN_METHOD.
        assert await b.rpc.call(a.peer_id, "ping", "up") == "up"
        with pytest.raises(meshd.UnknownMethod):
            await b.rpc.call(a.peer_id, "crdt.push", {})
        # Without the nat service there is no relay route to offer.
        with pytest.raises(meshd.ServiceOff, match="the nat service is off"):
            await a.connect_via(b.peer_id, b.peer_id)


async def test_a_call_the_peer_never_saw_is_sent_again_when_its_connection_is_replaced(tmp_path):
    """A node retiring a replaced connection names the last call it accepted on
    it (like HTTP/2's GOAWAY): a later call on it is sent again, an earlier one
    (maybe acted on) fails."""
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0") as a, \
            meshd.open_node(tmp_path / "b", listen="127.0.0.1:0") as b:
        calls, started = [], trio.Event()

        async def note(arg, ctx):
            calls.append(arg)
            return arg

        async def hold(arg, ctx):
            calls.append(arg)
            started.set()
            await trio.sleep_forever()

        a.rpc.register("note", note)
        a.rpc.register("hold", hold)
        with trio.fail_after(10):
            await b.connect(a.address)

            async def seen_call():
                with pytest.raises(meshd.Unavailable, match="replaced") as info:
                    await b.rpc.call(a.peer_id, "hold", "seen")
                assert not info.value.unprocessed

            async with trio.open_nursery() as nursery:
                nursery.start_soon(seen_call)
                await started.wait()
                a.live(b.peer_id).close_replaced()
            assert calls == ["seen"]

            await b.connect(a.address)
            conn_b = b.live(a.peer_id)
            b.endpoint.send_datagram = lambda data, addr: True  # b's next packets are lost
            async with trio.open_nursery() as nursery:
                result = []

                async def unseen_call():
                    result.append(await b.rpc.call(a.peer_id, "note", "unseen"))

                nursery.start_soon(unseen_call)
                await trio.testing.wait_all_tasks_blocked()
                assert conn_b.open_streams >= 1  # the call (and identify) never reached a
                a.live(b.peer_id).close_replaced()
                del b.endpoint.send_datagram
            assert result == ["unseen"] and calls == ["seen", "unseen"]
            assert b.live(a.peer_id) is not conn_b
