"""Limits read from a node's config.toml bind on real connections (docs/security.md)."""

import trio
import trio.testing

import meshd
from meshd.config import CONFIG_FILE
from meshd.identity import Identity
from meshd.rpc import protocol as P
from meshd.transport import Endpoint, TransportConfig
from meshd.wire import encode_frame

from settle import settle


async def test_a_node_serves_at_most_transport_max_streams_calls_of_one_peer_at_once(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / CONFIG_FILE).write_text("[transport]\nmax_streams = 2\nsend_high_water = 1048576\n")
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0", services=[]) as a, \
            meshd.open_node(tmp_path / "b", listen="127.0.0.1:0", services=[]) as b:
        assert a.config.transport.max_streams == 2
        running, release = [0, 0], trio.Event()  # now, most at once
        entered = trio.lowlevel.ParkingLot()

        async def hold(arg, ctx):
            running[0] += 1
            running[1] = max(running)
            entered.unpark_all()
            try:
                await release.wait()
            finally:
                running[0] -= 1
            return arg

        a.rpc.register("hold", hold)
        with trio.fail_after(20):
            await b.connect(a.address)
            await a.wait_connected(b.peer_id)
            assert (a.live(b.peer_id).send_high_water, b.live(a.peer_id).send_high_water) == (1 << 20, 4 << 20)
            results = []

            async def call(n):
                results.append(await b.rpc.call(a.peer_id, "hold", n))

            async with trio.open_nursery() as nursery:
                for n in range(5):
                    nursery.start_soon(call, n)
                while running[0] < 2:
                    await entered.park()
                await trio.testing.wait_all_tasks_blocked()  # nothing more runs or is on its way (loopback):
                # the other three wait for QUIC stream credit, not for a handler
                assert running == [2, 2]
                release.set()
            assert sorted(results) == list(range(5)) and running[1] == 2
            # the other direction is b's own default: 5 at once
            b.rpc.register("hold", hold)
            release, running[1] = trio.Event(), 0
            async with trio.open_nursery() as nursery:
                for n in range(5):
                    nursery.start_soon(a.rpc.call, b.peer_id, "hold", n)
                while running[0] < 5:
                    await entered.park()
                release.set()
            assert running[1] == 5


async def test_a_busy_node_serves_the_peer_with_fewest_calls_running_before_a_floods_backlog(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / CONFIG_FILE).write_text("[rpc]\nbusy_calls = 2\npeer_share = 1\n")
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0", services=[]) as a, \
            meshd.open_node(tmp_path / "b", listen="127.0.0.1:0", services=[]) as b, \
            meshd.open_node(tmp_path / "c", listen="127.0.0.1:0", services=[]) as c:
        entered = []  # (caller, arg) of each call that reached a's handler, in order
        released = {n: trio.Event() for n in [*range(6), 10, 11]}
        answered = []

        async def hold(arg, ctx):
            entered.append((ctx.peer, arg))
            await released[arg].wait()
            return arg

        async def call(node, n):
            answered.append(await node.rpc.call(a.peer_id, "hold", n))

        a.rpc.register("hold", hold)
        with trio.fail_after(20):
            await b.connect(a.address)
            await c.connect(a.address)
            async with trio.open_nursery() as nursery:
                for n in range(6):  # b floods: two run (the node is then busy), four wait
                    nursery.start_soon(call, b, n)
                await settle(lambda: a.rpc.server.calls_waiting == 4)
                assert [peer for peer, _ in entered] == [b.peer_id, b.peer_id]
                nursery.start_soon(call, c, 10)  # c runs nothing: under its share, it starts at once
                await settle(lambda: len(entered) == 3)
                assert entered[2] == (c.peer_id, 10)
                nursery.start_soon(call, c, 11)  # c has its share running: it waits behind nobody of its own
                await settle(lambda: a.rpc.server.calls_waiting == 5)
                first = entered[0][1]
                released[first].set()  # still busy (b 1, c 1 running): nothing starts
                await settle(lambda: answered == [first])
                assert len(entered) == 3
                released[10].set()  # not busy: c runs fewer calls than b, so c's goes before b's older four
                await settle(lambda: len(entered) == 4)
                assert entered[3] == (c.peer_id, 11)
                for event in released.values():
                    event.set()
            assert sorted(answered) == [*range(6), 10, 11] and a.rpc.server.calls_waiting == 0
            assert [peer for peer, _ in entered[4:]] == [b.peer_id] * 4


async def test_a_reader_that_never_reads_makes_a_node_queue_at_most_connection_send_high_water(tmp_path):
    cap = 1 << 20
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / CONFIG_FILE).write_text(f"[transport]\nconnection_send_high_water = {cap}\n")
    reader_config = TransportConfig(stream_window=64 << 10, connection_window=256 << 10)
    reader = Endpoint(Identity.generate(), reader_config, on_connection=lambda c: None,
                      on_connection_lost=lambda c: None)
    served = []

    async def blob(n, ctx):
        served.append(n)
        return b"x" * n

    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0", services=[]) as a, \
            trio.open_nursery() as nursery:
        a.rpc.register("blob", blob)
        with trio.fail_after(20):
            await nursery.start(reader.serve, "127.0.0.1", 0)
            conn = await reader.dial(a.address.hostport.host, a.address.hostport.port, a.peer_id)
            request = encode_frame(P.request_frame("blob", None, P.UNARY, 512 << 10))
            for _ in range(8):  # 4 MiB of answers asked for, 256 KiB of credit given, nothing read
                await conn.open_stream().send_all(request, eof=True)
            await settle(lambda: len(served) == 8)
            await trio.testing.wait_all_tasks_blocked()  # their writes have gone as far as they can
            at_a = a.live(reader.identity.peer_id)
            queued = sum(at_a.send_buffered(stream_id) for stream_id in list(at_a.quic._streams))
            assert 0 < queued <= cap
        nursery.cancel_scope.cancel()
