"""The async client's one connection to the control socket, in one process: calls of
every kind share it, a cancelled call leaves the others alone, and a client that dies
or talks nonsense costs the daemon only its own connection."""

import socket

import pytest
import trio
import trio.testing

import meshd
from meshd.control import server as control_server_module
from meshd.control.mux import DATA, HEADER
from meshd.control.server import control_server, serve_control
from meshd.control.socket import socket_path
from meshd.rpc.client import bidi_call, client_stream_call


class Daemon:
    """A control server whose handlers report what they saw."""

    def __init__(self):
        self.connections = 0
        self.cancelled = 0
        self.hanging = trio.Semaphore(0)  # released once per hang handler started
        self.sessions = []  # the daemon's side of each connection

    def methods(self) -> dict:
        async def echo(arg, ctx):
            return arg

        async def hang(arg, ctx):
            self.hanging.release()
            try:
                await trio.sleep_forever()
            finally:
                self.cancelled += 1

        async def count(n, ctx):
            for i in range(n):
                yield i

        async def total(items, ctx):
            return sum([item async for item in items])

        async def double(channel, ctx):
            async for item in channel:
                await channel.send(item * 2)

        async def starts_work(arg, ctx):
            self.nursery.start_soon(self.look_at_the_reply)
            return arg

        return {"echo": echo, "hang": hang, "count": count, "starts_work": starts_work,
                "total": (total, "client_stream"), "double": (double, "bidi")}

    async def look_at_the_reply(self):
        """(A task a handler started:) note whether the reply has left the daemon's side."""
        self.replied_first.append(not any(session._mux.wants_to_send for session in self.sessions))


@pytest.fixture
async def daemon(nursery, tmp_path, monkeypatch):
    state = Daemon()

    class CountingSession(control_server_module.MuxSession):
        async def serve(self, handle):
            state.connections += 1
            state.sessions.append(self)
            await super().serve(handle)

    monkeypatch.setattr(control_server_module, "MuxSession", CountingSession)
    server = control_server({})
    for name, method in state.methods().items():
        handler, kind = method if isinstance(method, tuple) else (method, None)
        server.register(name, handler, kind=kind)
    await nursery.start(serve_control, tmp_path, server)
    state.path = socket_path(tmp_path)
    return state


async def test_calls_of_every_kind_share_one_connection(daemon):
    client = meshd.Client(daemon.path)
    results = {}

    async def unary(i):
        results[i] = await client.request("echo", {"i": i, "pad": b"x" * (300 << 10)})

    async def streamed():
        results["count"] = [item async for item in client.stream("count", 500)]

    async def client_streamed():
        results["total"] = await client_stream_call(client._open, "total", range(100), 10, 1 << 20)

    async def bidi():
        async with bidi_call(client._open, "double", None, 10, 1 << 20) as channel:
            await channel.send(21)
            results["double"] = await channel.receive()

    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(unary, i)
        for fn in (streamed, client_streamed, bidi):
            nursery.start_soon(fn)
    await client.aclose()
    assert [results[i]["i"] for i in range(20)] == list(range(20))
    assert results["count"] == list(range(500)) and results["total"] == 4950 and results["double"] == 42
    assert daemon.connections == 1


async def test_a_reply_leaves_the_daemon_before_the_tasks_its_handler_started_run(daemon, nursery):
    """(It waited for the connection's writer task, behind them: a DHT put's other stores.)"""
    client = meshd.Client(daemon.path)
    await client.request("echo", 1)  # the connection is open
    daemon.nursery, daemon.replied_first = nursery, []
    for i in range(20):
        assert await client.request("starts_work", i) == i
        await trio.testing.wait_all_tasks_blocked()
    await client.aclose()
    assert daemon.replied_first == [True] * 20


async def test_a_cancelled_call_leaves_the_others_alone(daemon):
    client = meshd.Client(daemon.path)
    async with trio.open_nursery() as nursery:
        hung = trio.CancelScope()

        async def hang():
            with hung:
                await client.request("hang")

        nursery.start_soon(hang)
        async with client.stream("count", 3) as items:
            assert await items.__anext__() == 0
            await daemon.hanging.acquire()
            hung.cancel()
            assert await client.request("echo", "after") == "after"
            assert [item async for item in items] == [1, 2]
    with trio.fail_after(5):
        while daemon.cancelled < 1:
            await trio.sleep(0.01)
    assert await client.request("echo", "still") == "still"
    assert daemon.connections == 1
    await client.aclose()


async def test_an_unread_stream_does_not_hold_up_the_connection(daemon):
    """A stream whose reader stopped fills its own window; other calls go on."""
    client = meshd.Client(daemon.path)
    async with client.stream("count", 200_000) as items:
        await items.__anext__()
        with trio.fail_after(5):
            for _ in range(5):
                assert await client.request("echo", b"y" * 100_000) == b"y" * 100_000
    await client.aclose()


async def test_a_client_that_dies_mid_call_costs_the_daemon_nothing(daemon):
    client = meshd.Client(daemon.path)
    failures = []

    async def hang():
        try:
            await client.request("hang")
        except meshd.Unavailable as exc:
            failures.append(exc)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(hang)
        for _ in range(3):
            await daemon.hanging.acquire()
        client._session.discard()  # as if the process died: the socket closes under the calls
    assert len(failures) == 3
    with trio.fail_after(5):
        while daemon.cancelled < 3:
            await trio.sleep(0.01)
    other = meshd.Client(daemon.path)
    assert await other.request("echo", 1) == 1
    await other.aclose()


async def test_nonsense_costs_the_sender_its_connection_only(daemon):
    good = meshd.Client(daemon.path)
    assert await good.request("echo", 1) == 1
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(str(daemon.path))
        raw.sendall(HEADER.pack(1, DATA, 1 << 30))  # more than a frame may carry
        with trio.fail_after(5):
            assert await trio.to_thread.run_sync(raw.recv, 100) == b""  # the daemon hung up
    assert await good.request("echo", 2) == 2
    await good.aclose()


async def test_a_lost_connection_is_opened_again_by_the_next_call(daemon):
    client = meshd.Client(daemon.path)
    assert await client.request("echo", 1) == 1
    client._session.discard()
    assert await client.request("echo", 2) == 2
    assert daemon.connections == 2
    await client.aclose()
