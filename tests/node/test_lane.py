"""The TCP bulk lane (meshd.lane) between in-process nodes on loopback.

Bad clients are raw TCP sockets; "the server dropped us" is seen as end of
stream (or a reset) on the socket.  Token expiry uses a fake clock.
"""

from __future__ import annotations

import os
from contextlib import asynccontextmanager

import blake3
import msgpack
import pytest
import trio
import trio.testing

import meshd
from meshd import Config
from meshd.rpc import ResourceExhausted
from meshd.lane import (
    EMPTY_ID, TAG, Lane, LaneConfig, LaneError, LaneServer, _Framer, _keys, _token_id, open_lane,
)

METHOD = "shards.lane"  # the shard service's token method, which these tests' servers take over


def make_chunks(n: int, size: int) -> dict[bytes, bytes]:
    chunks = [os.urandom(size) for _ in range(n)]
    return {blake3.blake3(c).digest(): c for c in chunks}


def no_lane() -> Config:
    """A node config without the shard service's own lane: the tests start theirs."""
    config = Config()
    config.shards.lane = False
    return config


@asynccontextmanager
async def lane_nodes(tmp_path, chunks: dict, *, names: str = "ab", **server_args):
    """Node a serves ``chunks`` over a lane; the others are connected to a."""
    async with meshd.open_node(tmp_path / names[0], listen="127.0.0.1:0", config=no_lane()) as a:
        others = []
        async with trio.open_nursery() as nursery:
            server = LaneServer(a, chunks.get, host="127.0.0.1", **server_args)
            a.rpc.register(METHOD, server.issue)
            await nursery.start(server.serve)
            try:
                for name in names[1:]:
                    node = await _enter(nursery, tmp_path / name)
                    await node.connect(a.address)
                    others.append(node)
                yield a, server, *others
            finally:
                nursery.cancel_scope.cancel()


async def _enter(nursery: trio.Nursery, path) -> meshd.Node:
    """Open a node that lives until ``nursery`` is cancelled."""
    async def run(task_status=trio.TASK_STATUS_IGNORED):
        async with meshd.open_node(path, listen="127.0.0.1:0", config=no_lane()) as node:
            task_status.started(node)
            await trio.sleep_forever()
    return await nursery.start(run)


async def fetch_all(lane: Lane, ids: list[bytes]) -> list[tuple[bytes, bytes | None]]:
    return [item async for item in lane.fetch(ids)]


async def dropped(stream: trio.SocketStream) -> bool:
    """Whether the server closes ``stream`` (end of stream or reset) within 5 s."""
    with trio.fail_after(5):
        try:
            while await stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass
    return True


async def raw_hello(server: LaneServer, client: meshd.Node, server_node: meshd.Node,
                    reply: dict, *, as_peer=None) -> tuple[trio.SocketStream, _Framer, _Framer]:
    """Do the client side of the handshake by hand; (stream, rx, tx)."""
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    cnonce = os.urandom(16)
    c2s, s2c = _keys(reply["token"], reply["nonce"], cnonce, as_peer or client.peer_id, server_node.peer_id)
    await stream.send_all(_token_id(reply["token"]) + cnonce)
    return stream, _Framer(stream, s2c, (4 << 20) + TAG), _Framer(stream, c2s, 1 << 16)


async def test_fetch_chunks_and_missing(tmp_path):
    chunks = make_chunks(20, 1 << 20)
    small = make_chunks(40, 1000)
    async with lane_nodes(tmp_path, {**chunks, **small}) as (a, server, b):
        missing = os.urandom(32)
        ids = [*chunks, missing, EMPTY_ID]
        async with await open_lane(b, a.peer_id, method=METHOD) as lane:
            got = await fetch_all(lane, ids)
            assert [cid for cid, _ in got] == ids
            for cid, data in got[:20]:
                assert data == chunks[cid]
            assert got[20] == (missing, None)
            assert got[21] == (EMPTY_ID, b"")
            # A second fetch on the same lane, pipelined over several requests.
            many = [cid for _ in range(15) for cid in small] + [missing]  # 601 ids: 3 requests
            assert [d for _, d in await fetch_all(lane, many)] == [small.get(c) for c in many]
            # Borrowed: every chunk is a view of one reused buffer, right until the next comes.
            borrowed = [(cid, bytes(data) if data is not None else None, data)
                        async for cid, data in lane.fetch([*chunks, missing, *small], borrow=True)]
            assert [(cid, data) for cid, data, _ in borrowed] == [(c, {**chunks, **small}.get(c))
                                                                  for c in [*chunks, missing, *small]]
            views = [view for _, _, view in borrowed if view is not None]
            assert all(isinstance(v, memoryview) and v.obj is views[0].obj for v in views)


async def test_bad_clients_are_dropped_and_serving_goes_on(tmp_path):
    chunks = make_chunks(3, 1000)
    async with lane_nodes(tmp_path, chunks, limits=LaneConfig(handshake_timeout=0.3)) as (a, server, b):
        # A made-up token, then plain garbage, then a client that says nothing.
        for hello in (os.urandom(48), b"GET / HTTP/1.1\r\n\r\n" * 4):
            stream = await trio.open_tcp_stream("127.0.0.1", server.port)
            await stream.send_all(hello)
            assert await dropped(stream)
        silent = await trio.open_tcp_stream("127.0.0.1", server.port)
        assert await dropped(silent)
        # A real token, but the client then sends a request that is not one.
        for bad in (b"\xc1", msgpack.packb([b"x" * 31]), msgpack.packb([]),
                    msgpack.packb({"a": 1}), msgpack.packb([os.urandom(32)] * 257)):
            reply = await b.rpc.call(a.peer_id, METHOD, None)
            stream, rx, tx = await raw_hello(server, b, a, reply)
            assert await rx.receive() == b""  # the lane was up
            await tx.send(bad)
            assert await dropped(stream)
        # A frame header claiming more than the request limit.
        reply = await b.rpc.call(a.peer_id, METHOD, None)
        stream, rx, tx = await raw_hello(server, b, a, reply)
        await stream.send_all((100 << 20).to_bytes(4, "big"))
        assert await dropped(stream)
        async with await open_lane(b, a.peer_id, method=METHOD) as lane:
            assert dict(await fetch_all(lane, list(chunks))) == chunks
        assert not server._tokens


async def test_connections_without_an_outstanding_token_are_closed_at_once(tmp_path):
    chunks = make_chunks(2, 1000)
    async with lane_nodes(tmp_path, chunks, limits=LaneConfig(handshake_timeout=3.0)) as (a, server, b):
        with trio.fail_after(2.5):  # before any handshake times out
            stranger = await trio.open_tcp_stream("127.0.0.1", server.port)
            assert await dropped(stranger)  # no token issued: no slot
            await b.rpc.call(a.peer_id, METHOD, None)  # one token: one handshake slot
            squatter = await trio.open_tcp_stream("127.0.0.1", server.port)
            second = await trio.open_tcp_stream("127.0.0.1", server.port)
            assert await dropped(second)
        assert await dropped(squatter)  # silent until its handshake timed out
        async with await open_lane(b, a.peer_id, method=METHOD) as lane:  # the slot is free again
            assert dict(await fetch_all(lane, list(chunks))) == chunks


async def test_token_single_use_expiry_and_binding(tmp_path):
    now = [1000.0]
    chunks = make_chunks(1, 100)
    async with lane_nodes(tmp_path, chunks, names="abc", clock=lambda: now[0],
                          limits=LaneConfig(token_ttl=30.0)) as (a, server, b, c):
        await c.connect(a.address)
        reply = await b.rpc.call(a.peer_id, METHOD, None)
        assert set(reply) == {"port", "token", "nonce"} and len(reply["token"]) == 32
        # Bound to b: c holding b's token derives other keys; the server's first frame won't open.
        stream, rx, tx = await raw_hello(server, c, a, reply)
        with pytest.raises(LaneError, match="authentication"):
            await rx.receive()
        await stream.aclose()
        # ...and that try spent it: b cannot use it any more.
        stream, rx, tx = await raw_hello(server, b, a, reply)
        assert await dropped(stream)
        # Single use: the first connection works, the second is dropped.
        reply = await b.rpc.call(a.peer_id, METHOD, None)
        first, rx, tx = await raw_hello(server, b, a, reply)
        assert await rx.receive() == b""
        second, _, _ = await raw_hello(server, b, a, reply)
        assert await dropped(second)
        await tx.send(msgpack.packb(list(chunks)))
        assert await rx.receive() == next(iter(chunks.values()))
        await first.aclose()
        # Expiry: good just before 30 s, refused at 30 s.
        reply = await b.rpc.call(a.peer_id, METHOD, None)
        now[0] += 29.9
        stream, rx, _ = await raw_hello(server, b, a, reply)
        assert await rx.receive() == b""
        await stream.aclose()
        reply = await b.rpc.call(a.peer_id, METHOD, None)
        now[0] += 30.0
        stream, _, _ = await raw_hello(server, b, a, reply)
        assert await dropped(stream)


async def test_limits(tmp_path):
    async with lane_nodes(tmp_path, {}, limits=LaneConfig(tokens_per_peer=3, conns_per_peer=2)) as (a, server, b):
        replies = [await b.rpc.call(a.peer_id, METHOD, None) for _ in range(3)]
        with pytest.raises(ResourceExhausted):
            await b.rpc.call(a.peer_id, METHOD, None)
        lanes = []
        for reply in replies[:2]:
            stream, rx, _ = await raw_hello(server, b, a, reply)
            assert await rx.receive() == b""
            lanes.append(stream)
        stream, _, _ = await raw_hello(server, b, a, replies[2])
        assert await dropped(stream)  # a third connection for b
        with pytest.raises(ResourceExhausted):
            await b.rpc.call(a.peer_id, METHOD, None)
        assert await open_lane(b, a.peer_id, method=METHOD) is None
        await lanes[0].aclose()
        await trio.testing.wait_all_tasks_blocked(0.05)  # the server saw the close
        assert server._peer_conns[b.peer_id] == 1
        lane = await open_lane(b, a.peer_id, method=METHOD)
        assert lane is not None
        await lane.aclose()


async def _proxy(listen_port_box: list, target: int, flip_at: int | None, direction: str,
                 task_status=trio.TASK_STATUS_IGNORED):
    """One-connection TCP proxy to 127.0.0.1:``target``; flips one byte at offset
    ``flip_at`` of the ``direction`` ("down": server to client, "up") stream."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    listen_port_box.append(listeners[0].socket.getsockname()[1])
    task_status.started()
    client = await listeners[0].accept()
    upstream = await trio.open_tcp_stream("127.0.0.1", target)

    async def pump(src, dst, flip):
        seen = 0
        try:
            while data := await src.receive_some(1 << 16):
                if flip is not None and seen <= flip < seen + len(data):
                    data = bytearray(data)
                    data[flip - seen] ^= 0x01
                seen += len(data)
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        await trio.aclose_forcefully(dst)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump, client, upstream, flip_at if direction == "up" else None)
        nursery.start_soon(pump, upstream, client, flip_at if direction == "down" else None)


@pytest.mark.parametrize("direction,flip_at", [
    ("down", 20 + 4 + 3 * ((64 << 10) + 20) + 5000),  # inside the 4th chunk's body
    ("down", 20 + 2),  # the length of the first chunk's frame
    ("up", 48 + 4 + 10),  # inside the request
    ("up", 7),  # the token id
])
async def test_tampering_never_yields_wrong_data(tmp_path, direction, flip_at):
    chunks = make_chunks(8, 64 << 10)
    async with lane_nodes(tmp_path, chunks) as (a, server, b):
        real, box = server.port, []
        async with trio.open_nursery() as nursery:
            await nursery.start(_proxy, box, real, flip_at, direction)
            server.port = box[0]
            lane = await open_lane(b, a.peer_id, method=METHOD)
            if direction == "up" and flip_at < 48:
                assert lane is None  # the server knows no such token: no lane, use QUIC
                return
            got = []
            with pytest.raises(LaneError):
                async for cid, data in lane.fetch(list(chunks)):
                    got.append(cid)
                    assert data == chunks[cid]
            assert len(got) < len(chunks)
            with pytest.raises(LaneError):  # the lane is closed now
                await fetch_all(lane, list(chunks))
            server.port = real
            nursery.cancel_scope.cancel()
        async with await open_lane(b, a.peer_id, method=METHOD) as lane:  # the server serves on
            assert dict(await fetch_all(lane, list(chunks))) == chunks


async def test_leaving_a_fetch_early_closes_the_lane(tmp_path):
    chunks = make_chunks(10, 100_000)
    async with lane_nodes(tmp_path, chunks) as (a, server, b):
        lane = await open_lane(b, a.peer_id, method=METHOD)
        async for cid, data in lane.fetch(list(chunks)):
            assert data == chunks[cid]
            break
        with pytest.raises(LaneError):
            await fetch_all(lane, list(chunks))
        with pytest.raises(ValueError):
            await fetch_all(lane, [b"short"])
        await lane.aclose()
        # Leaving right after the last item keeps the lane.
        async with await open_lane(b, a.peer_id, method=METHOD) as lane:
            async for cid, data in lane.fetch(list(chunks)[:1]):
                break
            assert dict(await fetch_all(lane, list(chunks))) == chunks


async def test_open_lane_none_without_a_lane(tmp_path):
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0", config=no_lane()) as a, \
            meshd.open_node(tmp_path / "b", listen="127.0.0.1:0", config=no_lane()) as b:
        assert await open_lane(b, a.peer_id, method=METHOD) is None  # not connected: no direct path known
        await b.connect(a.address)
        assert await open_lane(b, a.peer_id, method=METHOD) is None  # UNKNOWN_METHOD: a serves no lane
        # A lane RPC that answers a port where nothing listens.
        async def fake(arg, ctx):
            sock = trio.socket.socket()
            await sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            sock.close()
            return {"port": port, "token": os.urandom(32), "nonce": os.urandom(16)}
        a.rpc.register(METHOD, fake)
        assert await open_lane(b, a.peer_id, method=METHOD) is None


async def test_open_lane_none_over_a_relayed_path():
    class Conn:
        remote_addr = ("relay", 7)
        path = "relayed"

    class FakeNode:
        def live(self, peer):
            return Conn()

    assert await open_lane(FakeNode(), object(), method=METHOD) is None


async def test_async_get_chunk_failures_and_idle_timeout(tmp_path):
    chunks = make_chunks(3, 5000)
    bad = os.urandom(32)

    class Source(dict):
        async def fetch(self, cid):  # async, as a store read in a worker thread would be
            await trio.lowlevel.checkpoint()
            if cid == bad:
                raise OSError("disk trouble")
            return self.get(cid)

    source = Source(chunks)
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0") as a, \
            meshd.open_node(tmp_path / "b", listen="127.0.0.1:0") as b, trio.open_nursery() as nursery:
        server = LaneServer(a, source.fetch, host="127.0.0.1", limits=LaneConfig(idle_timeout=0.3))
        a.rpc.register(METHOD, server.issue)  # in place of the shard service's own lane
        await nursery.start(server.serve)
        await b.connect(a.address)
        async with await open_lane(b, a.peer_id, method=METHOD) as lane:
            got = await fetch_all(lane, [bad, *chunks])
            assert got == [(bad, None), *chunks.items()]  # the failing read is "not here"
        # A lane nobody uses is closed after idle_timeout.
        reply = await b.rpc.call(a.peer_id, METHOD, None)
        stream, rx, _ = await raw_hello(server, b, a, reply)
        assert await rx.receive() == b""
        assert await dropped(stream)
        nursery.cancel_scope.cancel()


async def test_the_lane_section_of_a_nodes_config_bounds_both_services_lanes(tmp_path):
    """``[lane]`` reaches the shard service's lane and the learning service's: a peer gets
    ``tokens_per_peer`` tokens from each, then RESOURCE_EXHAUSTED."""
    config = Config()
    config.update({"lane": {"tokens_per_peer": 2}})  # as a config file's [lane] section sets it
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0", config=config) as a, \
            meshd.open_node(tmp_path / "b", listen="127.0.0.1:0") as b:
        await b.connect(a.address)
        for method in ("shards.lane", "learning.lane"):
            for _ in range(2):
                assert len((await b.rpc.call(a.peer_id, method, None))["token"]) == 32
            with pytest.raises(meshd.RpcError, match="RESOURCE_EXHAUSTED|too many"):
                await b.rpc.call(a.peer_id, method, None)
