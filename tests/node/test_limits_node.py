"""Limits read from a node's config.toml bind on real connections (docs/security.md)."""

import trio

import meshd
from meshd.config import CONFIG_FILE


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
                await trio.sleep(0.5)  # the other three wait for QUIC stream credit, not for a handler
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
