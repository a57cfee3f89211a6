"""meshctl's blocking client against a real control socket server, in one process.

The server runs in trio; each blocking call runs in a worker thread, as
meshctl runs it in its own process: replies, typed errors, streams, an early
close that cancels the handler, deadlines, and no daemon at all.
"""

import functools

import pytest
import trio

import meshd
from meshd.client.blocking import BlockingClient, run
from meshd.control.server import control_server, serve_control
from meshd.control.socket import socket_path


@pytest.fixture
async def daemon(nursery, tmp_path):
    """A control server with a few methods; ``.stopped`` is set when ``forever``'s handler ends."""
    stopped = trio.Event()

    async def echo(arg, ctx):
        return arg

    async def refuse(arg, ctx):
        raise meshd.InvalidArgument("not like that")

    async def hang(arg, ctx):
        await trio.sleep_forever()

    async def count(n, ctx):
        for i in range(n):
            yield i

    async def forever(arg, ctx):
        try:
            for i in range(10):
                yield i
            await trio.sleep_forever()
        finally:
            stopped.set()

    server = control_server({"echo": echo, "refuse": refuse, "hang": hang, "count": count, "forever": forever})
    await nursery.start(serve_control, tmp_path, server)
    client = BlockingClient(socket_path(tmp_path))
    client.stopped = stopped
    return client


async def blocking(fn, *args):
    """``run(fn, *args)`` in a worker thread (it blocks), from trio."""
    return await trio.to_thread.run_sync(functools.partial(run, fn, *args), abandon_on_cancel=True)


async def test_a_call_gets_its_reply_and_the_error_the_handler_raised(daemon):
    assert await blocking(daemon.request, "echo", {"a": [1, b"x"]}) == {"a": [1, b"x"]}
    with pytest.raises(meshd.InvalidArgument, match="not like that"):
        await blocking(daemon.request, "refuse")
    with pytest.raises(meshd.UnknownMethod):
        await blocking(daemon.request, "nope")


async def test_a_deadline_is_deadline_exceeded(daemon):
    with trio.fail_after(5):
        # the client's 0.2 s and the deadline it sent the daemon end together: either may say so
        with pytest.raises(meshd.DeadlineExceeded,
                           match="hang did not answer within 0.2 s|hang did not finish before its deadline"):
            await blocking(daemon.request, "hang", None, 0.2)


async def test_a_stream_yields_every_item_and_an_early_close_cancels_the_handler(daemon):
    async def items():
        return [item async for item in daemon.stream("count", 3)]

    assert await blocking(items) == [0, 1, 2]

    async def first_two():
        async with daemon.stream("forever") as stream:
            return [await stream.__anext__(), await stream.__anext__()]

    assert await blocking(first_two) == [0, 1]
    with trio.fail_after(5):
        await daemon.stopped.wait()


async def test_the_client_methods_run_unchanged(daemon):
    """A capability's method (``document``, of :mod:`meshd.client.crdt`) runs over the blocking socket."""
    with pytest.raises(meshd.UnknownMethod, match="crdt.open"):
        await blocking(daemon.document, "run42")


async def test_no_daemon_is_daemon_not_running(tmp_path):
    client = BlockingClient(socket_path(tmp_path / "nothing"))
    with pytest.raises(meshd.DaemonNotRunning, match="no meshd is running"):
        await blocking(client.status)
